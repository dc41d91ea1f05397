"""Exercise 3.3, a plausible wrong answer: the model states alone (16Ψ / 2 = 64 GB at dp 2) fit,
forgetting the activations, which ZeRO does not cut."""

ANSWER = 2
