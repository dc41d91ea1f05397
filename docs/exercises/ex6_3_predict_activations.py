"""Exercise 6.3 (chapter 6), predict: activations held by the first stage.

p = 4 stages, m = 8 micro-batches. A rank holds a micro-batch's activations from its forward until
its backward. At its worst moment, how many micro-batches' activations does rank 0 (the first
stage) hold under GPipe, and how many under 1F1B? Write both below. The answer key is the
schedules themselves (minipar.pipeline.schedules.peak_activations).

Check: make exercise N=6.3
"""

ANSWER = None  # (under GPipe, under 1F1B), two whole numbers
