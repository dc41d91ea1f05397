"""Exercise 6.2, wrong: the bubble over the work, (p - 1) / m, not over the whole time."""


def formula(v):
    return (v.p - 1) / v.m


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 0.4
