"""Exercise 0.3, read off the file's own sweep: 31.3 MiB of activations against 28.0 MiB of states."""

ANSWER = 512
