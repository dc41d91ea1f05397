"""Exercise 3.2 (chapter 3, "The collectives: why stages 0-2 cost 2Ψ(N-1)/N and stage 3 3Ψ(N-1)/N"),
predict: what ZeRO-3 sends.

A model (minipar/model.py's CONFIGS: count its Ψ parameters) in float32, data-parallel over dp
ranks with ZeRO-3, one micro-batch per step; `make exercise N=3.2` prints your model and dp (drawn
from SEED below). How many MiB does one rank send on the dp group in a step? (Which collectives
run, on how many bytes each, and what fraction of a payload does the ring send?) The answer key
is the estimator's `bytes_sent` (minipar/planning/traffic.py), which equals the ledger (2%
tolerance).

Check: make exercise N=3.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # MiB one rank sends on dp per step
