"""Exercise 8.3, a plausible wrong answer: 6 FLOPs per parameter and token, attention forgotten."""

ANSWER = 6 * 8.03e9 * 1024 * 8192 / (8 * 989e12 * 0.45)
