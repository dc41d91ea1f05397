"""Exercise 2.3, a plausible wrong answer: 7 MiB of gradients divided by the bucket size, rounded
(a bucket closes only once it holds at least the size, and one parameter may fill several)."""

ANSWER = (28, 7, 1)
