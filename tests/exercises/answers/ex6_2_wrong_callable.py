"""Exercise 6.2, wrong (issue 40's walk-around): the simulated timeline itself: ANSWER a function of the variant,
run by the checker, not a prediction. A prediction is a value written out; code that computes it is refused."""

from minipar.pipeline.schedules import build
from minipar.pipeline.timeline import simulate


def ANSWER(v):  # noqa: N802
    return simulate(build("gpipe", v.p, v.m)).idle_fraction()
