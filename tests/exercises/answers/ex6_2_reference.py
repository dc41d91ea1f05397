"""Exercise 6.2, an answer: each rank works m (F + B) and waits (p - 1)(F + B) for the pipeline to
fill and drain: (p - 1) / (m + p - 1)."""


def formula(v):  # a function of the variant (v.p, v.m)
    return (v.p - 1) / (v.m + v.p - 1)


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 0.2857142857142857
