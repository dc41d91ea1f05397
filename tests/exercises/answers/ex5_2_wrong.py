"""Exercise 5.2, wrong: the imbalance taken to be cp (the last rank's positions are about cp times
rank 0's... on average, but its work is the sum over them, rank 0's starting at 1)."""


def ANSWER(v):  # noqa: N802
    return v.cp
