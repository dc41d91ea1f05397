"""Exercise 5.2, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""


def ANSWER(v):  # noqa: N802 - a function of the variant (v.cp, v.seq_len)
    c = v.seq_len // v.cp
    return ((v.cp - 1) * c + (c + 1) / 2) / ((c + 1) / 2)
