"""Exercise 6.2 (chapter 6), predict: GPipe's bubble.

GPipe on p stages with m micro-batches, a forward taking one unit of time and a backward two;
`make exercise N=6.2` prints your p and m (drawn from SEED below). What fraction of the ranks'
time is idle (the bubble as an idle fraction, over the whole step: not the bubble ratio, over the
work alone; chapter 6, "The bubble", gives both)? Work it out on paper first, then write it below
as a number (a fraction like 3 / 7 is fine). The answer key is the simulated timeline
(minipar.pipeline.timeline.simulate). Chapter 6's script draws one for p = 4, m = 8 on 4 ranks:

    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_06_pipeline.py

Check: make exercise N=6.2
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # the idle fraction, between 0 and 1
