"""Exercise 1.3, read off the file's sweep. The bandwidth term, 2(N-1)/N * S * beta, approaches
twice its N = 2 value but never reaches it, so only the latency's growth, 2(N-1) alpha, can double
the time. At 1 MiB the latency is a fifth of the time on 2 ranks (160 of 737 µs), and the time
doubles by N = 5; at 64 MiB it is a 230th, and it takes N = 24."""

ANSWER = (5, 24)
