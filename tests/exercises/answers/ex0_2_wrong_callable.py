"""Exercise 0.2, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""


def ANSWER(v):  # noqa: N802 - a function of the variant (v.b, v.s), so that it passes for every seed
    return 30.93 * v.b * v.s / (4 * 128)
