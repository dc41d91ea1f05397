"""Exercise 8.2 (chapter 8, "Choosing a layout"), explore: which layout the planner picks.

Llama-3.1-8B on G H100s (80 GB, 10% kept free, 8 a node), B sequences of s tokens a step; `make exercise N=8.2`
prints your G, B and s (drawn from SEED below) and four layouts of those G GPUs:

    A  plain FSDP: --dp G --zero 3          B  --dp G/2 --cp 2 --zero 3
    C  --tp 8 --sp --zero 1 (dp G/8)        D  --dp G/4 --pp 4 --zero 1

Which one does the planner rank fastest among those that fit? Run it on your case, read its table
(fit, memory, and the seconds by part), and write the letter. Chapter 8 answers a case of its own
(8 GPUs, 8,192 tokens); yours is another, where the winner changes. Then explain from the parts
why the others lose (or do not fit).

    python scripts/tools/plan.py --model 8b --gpus G --seq-len s --global-batch B --top 60

Check: make exercise N=8.2 (a few seconds: it asks the planner about the four)
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # "A", "B", "C" or "D"
