"""Exercise 5.2, wrong: the imbalance taken to be cp (the last rank's positions are about cp times
rank 0's... on average, but its work is the sum over them, rank 0's starting at 1)."""


def formula(v):
    return v.cp


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 8
