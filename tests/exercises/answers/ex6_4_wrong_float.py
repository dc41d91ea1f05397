"""Exercise 6.4, wrong: the bubble compared with 10% in floating point. At m = 27 it is 3/30, exactly
10%, which is not under 10%; but the simulated idle fraction is 1 - 27/30, which floats round to
0.09999999999999998, under 0.10: a float comparison takes 27 (issue 40: the old key did)."""

from minipar.pipeline.schedules import build
from minipar.pipeline.timeline import simulate

ANSWER = next(m for m in range(1, 100) if simulate(build("1f1b", 4, m)).idle_fraction() < 0.10)
