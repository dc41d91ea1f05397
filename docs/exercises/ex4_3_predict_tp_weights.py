"""Exercise 4.3 (chapter 4, "One matmul, two ways to cut it" and "The vocabulary"), predict: the
weights of one rank.

A model of minipar/model.py's CONFIGS in float32 at tensor parallelism tp; `make exercise N=4.3`
prints your model and tp (drawn from SEED below). How many MiB of weights does one rank hold?
Think about what is cut (attention's and the MLP's matrices, the embedding and the LM head by
vocabulary) and what every rank keeps whole (the norms). The answer key is the estimator's
`held_bytes` (minipar/planning/estimate.py), which builds the rank's part of the model with
`parallelize` (2% tolerance).

Check: make exercise N=4.3
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # MiB of float32 weights on one rank at your tp
