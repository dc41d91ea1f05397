"""Exercise 4.2, a plausible wrong answer: each rank sends half as much at tp 4 (as its weights)."""

ANSWER = 0.5
