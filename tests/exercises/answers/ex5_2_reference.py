"""Exercise 5.2, the sums: rank 3's tokens 768-1023 against rank 0's 0-255."""

ANSWER = sum(range(769, 1025)) / sum(range(1, 257))
