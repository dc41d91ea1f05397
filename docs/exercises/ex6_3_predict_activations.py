"""Exercise 6.3 (chapter 6), predict: activations held by one stage.

p stages, m micro-batches, and one rank r (it holds stage r); `make exercise N=6.3` prints your
p, m and r (drawn from SEED below). A rank holds a micro-batch's activations from its forward
until its backward. At its worst moment, how many micro-batches' activations does rank r hold
under GPipe, and how many under 1F1B? Write both below. The answer key is the schedules
themselves (minipar.pipeline.schedules.peak_activations).

Check: make exercise N=6.3
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # (under GPipe, under 1F1B), two whole numbers
