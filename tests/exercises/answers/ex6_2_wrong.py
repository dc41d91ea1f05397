"""Exercise 6.2, wrong: the bubble over the work, (p - 1) / m, not over the whole time."""


def ANSWER(v):  # noqa: N802
    return (v.p - 1) / v.m
