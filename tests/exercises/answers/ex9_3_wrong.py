"""Exercise 9.3, wrong: every kind of group taken to cross nodes."""


def ANSWER(v):  # noqa: N802
    return ["tp", "cp", "dp", "pp"]
