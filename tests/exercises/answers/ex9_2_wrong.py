"""Exercise 9.2, a plausible wrong answer: ZeRO-3, thought to cut the most."""

ANSWER = "B"
