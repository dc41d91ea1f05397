"""Exercise 7.3, a plausible wrong answer: four times the ranks, four times the traffic."""

ANSWER = 4
