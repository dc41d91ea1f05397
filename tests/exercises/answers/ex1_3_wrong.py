"""Exercise 1.3, a plausible wrong answer: the bandwidth term alone, which never doubles at 64 MiB."""

ANSWER = (4, 32)
