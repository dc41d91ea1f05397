"""Exercise 8.3, wrong: 6 Psi per token alone (attention's FLOPs forgotten)."""


def formula(v):
    return 6 * 8.03e9 * v.global_batch * v.seq_len / (v.gpus * 989e12 * 0.45)


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 28.379053859116954
