"""Exercise 9.2, a plausible wrong answer: chapter 9's layout that holds the least (F), copied,
though the question is which sends the least within the budget."""


def ANSWER(v):  # noqa: N802 - the chapter's letter, whatever the variant
    return "F"
