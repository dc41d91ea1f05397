"""Exercise 9.2, a plausible wrong answer: chapter 9's layout that holds the least (F), copied,
though the question is which sends the least within the budget."""


def formula(v):  # the chapter's letter, whatever the variant
    return "F"


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 'F'
