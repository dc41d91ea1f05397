"""Exercise 4.3, a plausible wrong answer: the embedding and the LM head thought whole on every rank."""

ANSWER = (1_836_160 - 2 * 4096 * 128) * 4 / 2 / 2**20 + 2 * 4096 * 128 * 4 / 2**20
