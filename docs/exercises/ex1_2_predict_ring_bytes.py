"""Exercise 1.2 (chapter 1, "What a collective costs: the ring"), predict: bytes per rank.

Four ranks each hold a float32 tensor of 1,048,576 elements (S = 4 MiB = 4,194,304 bytes). By the
ring algorithm, how many bytes does one rank send in
    an all-reduce of it,  a reduce-scatter of it,  an all-gather whose result is S bytes?
Write the three numbers of bytes. The answer key is the ledger's own formula,
`ring_bytes_sent` in minipar/collectives.py; `scripts/step_01_collectives.py` prints the ledger.

Check: make exercise N=1.2
"""

ANSWER = None  # (all_reduce, reduce_scatter, all_gather), bytes one rank sends
