"""Exercise 1.2, wrong: the all-reduce priced as one pass round the ring, like the other two."""


def formula(v):
    S, N = 4 * v.elements, v.n
    return (N - 1) * S // N, (N - 1) * S // N, (N - 1) * S // N


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = (1260000, 1260000, 1260000)
