"""Exercise 4c.2 (chapter 4c, "In each layout"), predict: what Muon's gather adds under ZeRO-1.

A model (minipar/model.py's CONFIGS) in fp32 with --optimizer muon (Muon on the seven matrices of
each block, AdamW on the rest), data-parallel over dp ranks with ZeRO-1 and --muon-method gather,
buckets of 0.25 MiB (small enough that every Muon bucket's slices cut a matrix). `make exercise
N=4c.2` prints your model and dp (drawn from SEED below). How many MiB does one rank send a step
beyond what ZeRO-1 sends for AdamW? (Which buckets are gathered, in which dtype, and what fraction
of a payload does the ring send?) The answer key is the estimator's (planning/estimate_muon.py),
which equals the ledger (2% tolerance: the buckets' padding).

Check: make exercise N=4c.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # MiB one rank sends per step beyond ZeRO-1's own messages
