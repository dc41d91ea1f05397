"""Exercise 0.2, a plausible wrong answer: twice the tokens (only the sequence counted), 2x."""

ANSWER = 61.9
