"""Exercise 6.2, an answer: each rank works m (F + B) and waits (p - 1)(F + B) for the pipeline to
fill and drain: (p - 1) / (m + p - 1)."""


def ANSWER(v):  # noqa: N802 - a function of the variant (v.p, v.m)
    return (v.p - 1) / (v.m + v.p - 1)
