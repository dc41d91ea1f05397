"""Exercise 6.2 (chapter 6), predict: GPipe's bubble.

GPipe on p stages with m micro-batches, a forward taking one unit of time and a backward two;
`make exercise N=6.2` prints your p and m (drawn from SEED below). What fraction of the ranks'
time is idle (the bubble)? Work it out on paper first, then write it below as a number (a
fraction like 3 / 7 is fine). The answer key is the simulated timeline
(minipar.pipeline.timeline.simulate); `python scripts/step_06_pipeline.py` draws one.

Check: make exercise N=6.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # the idle fraction, between 0 and 1
