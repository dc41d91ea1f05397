"""Exercise 10b.1, wrong: checkpoint-restart loses a whole interval per failure, not half of one on average."""


def ANSWER(v):  # noqa: N802
    failures = v.gpus * v.days * 24 / v.mtbf
    restart = v.restart_min / 60
    return failures * v.gpus * (restart + v.checkpoint_hours), failures * v.group_gpus * restart
