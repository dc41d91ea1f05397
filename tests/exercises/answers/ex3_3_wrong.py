"""Exercise 3.3, a plausible wrong answer: model states alone (16Ψ / dp = 32 GB at dp 4) fit."""

ANSWER = 4
