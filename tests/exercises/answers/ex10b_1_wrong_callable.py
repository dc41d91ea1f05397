"""Exercise 10b.1, wrong (issue 40's walk-around): minipar.extras.replicas.lost_gpu_hours (the function the
chapter names), called on the variant, not a prediction. A prediction is a value written out; code that
computes it is refused."""

from minipar.extras.replicas import lost_gpu_hours


def ANSWER(v):  # noqa: N802
    hours, restart = v.days * 24, v.restart_min / 60
    return (lost_gpu_hours(v.gpus, v.mtbf, hours, restart, checkpoint_every_hours=v.checkpoint_hours),
            lost_gpu_hours(v.gpus, v.mtbf, hours, restart, group_gpus=v.group_gpus))
