"""Exercise 6.3, the answer from the chapter: GPipe holds every micro-batch (m) before its first
backward; 1F1B's first stage at most p (its warm-up of p-1, plus the one in flight)."""

P, M = 4, 8
ANSWER = (M, P)
