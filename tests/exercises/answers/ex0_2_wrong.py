"""Exercise 0.2, wrong: activations taken to grow with s squared (an attention matrix minipar never keeps)."""


def formula(v):
    return 30.93 * v.b / 4 * (v.s / 128) ** 2


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 742.3199999999999
