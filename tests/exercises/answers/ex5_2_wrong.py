"""Exercise 5.2, a plausible wrong answer: rank 3 thought to do 4 times rank 0's work (its last token's)."""

ANSWER = 4
