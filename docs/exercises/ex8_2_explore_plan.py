"""Exercise 8.2 (chapter 8, "Choosing a layout"), explore: which layout the planner picks.

Llama-3.1-8B on 8 H100s (80 GB, one node), sequences of 8,192 tokens, 1,024 per step. Of these
four layouts, which one does the planner rank fastest among those that fit?

    A  --dp 8 --zero 3        B  --dp 4 --cp 2 --zero 3
    C  --tp 8 --sp --zero 1   D  --dp 2 --pp 4 --zero 1

Run the planner, read its table (fit, memory, and the seconds by part), and write the letter.
Then explain from the parts why the others lose (or do not fit).

    python scripts/plan.py --model 8b --gpus 8 --seq-len 8192 --global-batch 1024 --top 40

Check: make exercise N=8.2 (a few seconds: it asks the planner about the four)
"""

ANSWER = None  # "A", "B", "C" or "D"
