"""Exercise 7.2, a plausible wrong answer: the forward only (tokens out, results back), half of it."""

ANSWER = 4 * 2 * 256 * 2 * 3 / 4 * 128 * 4 / 2**20
