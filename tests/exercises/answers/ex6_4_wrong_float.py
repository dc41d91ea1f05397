"""Exercise 6.4, wrong: the bubble compared with 10% in floating point. At m = 27 it is 3/30, exactly
10%, which is not under 10%; but 1 - 0.9 is 0.09999999999999998 in floats, and 0.1 < that is False
only by luck of rounding the other way: a float comparison took 27 (issue 40)."""

from minipar.planning.planner import pipeline_idle

ANSWER = next(m for m in range(1, 100) if pipeline_idle("1f1b", 4, m) < 1 - 0.9)
