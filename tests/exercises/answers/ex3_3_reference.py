"""Exercise 3.3, read off the file's sweep: 95.3 GB at dp 2, 63.2 GB at dp 4."""

ANSWER = 4
