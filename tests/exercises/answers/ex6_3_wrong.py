"""Exercise 6.3, a plausible wrong answer: 1F1B thought to hold one micro-batch at a time."""

ANSWER = (8, 1)
