"""Exercise 3.3, read off the file's sweep: 94.8 GB at dp 2, 62.7 GB at dp 4."""

ANSWER = 4
