"""Exercise 8.3, wrong: 6 Psi per token alone (attention's FLOPs forgotten)."""


def ANSWER(v):  # noqa: N802
    return 6 * 8.03e9 * v.global_batch * v.seq_len / (v.gpus * 989e12 * 0.45)
