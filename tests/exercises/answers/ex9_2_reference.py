"""Exercise 9.2, read off the file's sweep (chapter 9's table (d)): 5.49 MiB."""

ANSWER = "F"
