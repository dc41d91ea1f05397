"""Exercise 7.2, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""


def ANSWER(v):  # noqa: N802 - a function of the variant (v.ep, v.seq_len)
    return 4 * 4 * v.seq_len * 2 * (v.ep - 1) / v.ep * 128 * 4 / 2**20
