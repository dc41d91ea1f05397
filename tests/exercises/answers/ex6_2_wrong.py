"""Exercise 6.2, a plausible wrong answer: (p-1)/m, forgetting that the fill makes the step longer."""

ANSWER = "3/8"
