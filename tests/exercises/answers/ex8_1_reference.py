"""Exercise 8.1, an answer: weights, gradients and optimizer state, each cut by n from its stage on."""


def model_state_bytes(psi, n, stage, weight=2, grad=2, k=12):
    def cut(bytes_per_param, from_stage):
        return bytes_per_param / (n if stage >= from_stage else 1)

    return psi * (cut(weight, 3) + cut(grad, 2) + cut(k, 1))
