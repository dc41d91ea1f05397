"""Exercise 1.2, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""


def ANSWER(v):  # noqa: N802 - a function of the variant (v.n, v.elements)
    S, N = 4 * v.elements, v.n
    return 2 * (N - 1) * S // N, (N - 1) * S // N, (N - 1) * S // N
