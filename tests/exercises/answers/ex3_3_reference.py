"""Exercise 3.3, read off the file's sweep: 87.9 GB at dp 4, 71.9 GB at dp 8."""

ANSWER = 8
