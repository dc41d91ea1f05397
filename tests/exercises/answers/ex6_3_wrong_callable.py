"""Exercise 6.3, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""


def ANSWER(v):  # noqa: N802 - a function of the variant (v.p, v.m, v.rank)
    return v.m, min(v.p - v.rank, v.m)
