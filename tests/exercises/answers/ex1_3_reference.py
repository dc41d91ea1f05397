"""Exercise 1.3, read off the file's sweep: 1 MiB is latency-bound (the time doubles by N = 4);
64 MiB is bandwidth-bound, and its bandwidth term never doubles, so only latency doubles it (N = 12)."""

ANSWER = (4, 12)
