"""Exercise 5.3, a plausible wrong answer: 7 hops instead of 1, so 7 times as much (the blocks shrink too)."""

ANSWER = 7
