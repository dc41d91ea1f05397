"""Exercise 1.2 (chapter 1, "What a collective costs: the ring"), predict: bytes per rank.

N ranks each hold a float32 tensor of E elements (S = 4 E bytes); `make exercise N=1.2` prints
your N and E (drawn from SEED below). By the ring algorithm, how many bytes does one rank send in
    an all-reduce of it,  a reduce-scatter of it,  an all-gather whose result is S bytes?
Write the three numbers of bytes. The answer key is the ledger's own formula,
`ring_bytes_sent` in minipar/collectives.py; `scripts/course/step_01_collectives.py` prints the ledger.

Check: make exercise N=1.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # (all_reduce, reduce_scatter, all_gather), bytes one rank sends
