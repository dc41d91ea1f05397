"""Exercise 3.2, a plausible wrong answer: as ZeRO-1, 2Ψ(N-1)/N (the forward's gathers forgotten)."""

ANSWER = 2 * 0.75 * 1_836_160 * 4 / 2**20
