"""Exercise 6.4, a plausible wrong answer: (p-1)/m < 10%, forgetting the fill makes the step longer."""

ANSWER = 31
