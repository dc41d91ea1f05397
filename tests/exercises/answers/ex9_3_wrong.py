"""Exercise 9.3, a plausible wrong answer: dp thought to cross too (it spans ranks 8 apart)."""

ANSWER = ["dp", "pp"]
