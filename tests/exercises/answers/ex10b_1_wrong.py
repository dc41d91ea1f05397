"""Exercise 10b.1, wrong: checkpoint-restart loses a whole interval per failure, not half of one on average."""


def formula(v):
    failures = v.gpus * v.days * 24 / v.mtbf
    restart = v.restart_min / 60
    return failures * v.gpus * (restart + v.checkpoint_hours), failures * v.group_gpus * restart


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = (905969.6639999999, 2359.296)
