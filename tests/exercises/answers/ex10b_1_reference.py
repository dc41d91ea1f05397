"""Exercise 10b.1, an answer: G x hours / MTBF failures. Checkpoint-restart: each stops all G GPUs
for the restart plus half a checkpoint interval of lost work on average. Replica groups: each stops
only its group's GPUs, for the restart."""


def formula(v):  # a function of the variant (v.gpus, v.mtbf, v.days, ...)
    failures = v.gpus * v.days * 24 / v.mtbf
    restart = v.restart_min / 60
    return failures * v.gpus * (restart + v.checkpoint_hours / 2), failures * v.group_gpus * restart


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = (603979.776, 2359.296)
