"""Exercise 8.2, a plausible wrong answer: chapter 8's pick (--dp 4 --cp 2 --zero 3 at 8,192 tokens on
8 GPUs) copied for another case, where context parallelism is not the fastest that fits."""


def formula(v):  # the chapter's letter, whatever the variant
    return "B"


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 'B'
