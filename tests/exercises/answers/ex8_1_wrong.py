"""Exercise 8.1, a plausible wrong answer: stage 2 treated as stage 1 (the gradients left whole)."""


def model_state_bytes(psi, n, stage, weight=2, grad=2, k=12):
    return psi * (weight / (n if stage >= 3 else 1) + grad / (n if stage >= 3 else 1) + k / (n if stage >= 1 else 1))
