"""Exercise 1.2, wrong: the all-reduce priced as one pass round the ring, like the other two."""


def ANSWER(v):  # noqa: N802
    S, N = 4 * v.elements, v.n
    return (N - 1) * S // N, (N - 1) * S // N, (N - 1) * S // N
