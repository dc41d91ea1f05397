"""Exercise 7.2 (chapter 7, "Bytes"), predict: the all-to-all of a step.

The small-moe model (4 MoE blocks, dim 128, 8 experts, top-2) in float32 on ep ranks with
expert parallelism ep, one sequence of s tokens per rank and step; `make exercise N=7.2` prints
your ep and s (drawn from SEED below). With uniform routing, how many MiB does one rank send on
the ep group per step? Each assignment whose expert lives on another rank crosses twice forward
(the token out, its result back) and twice backward (their gradients). The answer key is the
estimator's `bytes_sent` (minipar/planning/traffic.py and estimate_moe.py; it also counts the small all-to-all
of the counts), which equals the ledger (2% tolerance).

Check: make exercise N=7.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # MiB one rank sends on ep per step
