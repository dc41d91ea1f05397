"""Exercise 9.3, wrong: every kind of group taken to cross nodes."""


def formula(v):
    return ["tp", "cp", "dp", "pp"]


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = ['tp', 'cp', 'dp', 'pp']
