"""Exercise 0.3, a plausible wrong answer: the first length printed after the crossover's neighbour."""

ANSWER = 256
