"""Exercise 3.2 (chapter 3, "The collectives: why stages 0-2 cost 2Ψ(N-1)/N and stage 3 3Ψ(N-1)/N"),
predict: what ZeRO-3 sends.

The small model (Ψ = 1,836,160 parameters) in float32, data-parallel over 4 ranks with ZeRO-3,
one micro-batch per step. How many MiB does one rank send on the dp group in a step? (Which
collectives run, on how many bytes each, and what fraction of a payload does the ring send?)
The answer key is the estimator's `bytes_sent` (minipar/planning/estimate.py), which equals the
ledger (2% tolerance).

Check: make exercise N=3.2
"""

ANSWER = None  # MiB one rank sends on dp per step
