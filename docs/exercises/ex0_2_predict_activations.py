"""Exercise 0.2 (chapter 0, "Where one step's memory goes"), predict: activations as tokens grow.

Chapter 0 measures the small model at a micro-batch of 4 x 128 tokens in float32: 30.93 MiB of
activations. How many MiB does it keep at your micro-batch of b x s tokens? `make exercise N=0.2`
prints your b and s (drawn from SEED below). Decide first what grows with the tokens (every
tensor a layer keeps is [b, s, something]; the logits are [b, s, vocab]) and whether anything
grows faster (minipar's attention keeps no s x s matrix). The answer key is the estimator,
`activation_bytes` in minipar/planning/estimate.py (3% tolerance).

Check: make exercise N=0.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # MiB of activations, the small model, float32, your micro-batch of b x s tokens
