"""Exercise 0.2, wrong: activations taken to grow with s squared (an attention matrix minipar never keeps)."""


def ANSWER(v):  # noqa: N802
    return 30.93 * v.b / 4 * (v.s / 128) ** 2
