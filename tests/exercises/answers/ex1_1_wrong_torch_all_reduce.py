"""Exercise 1.1, wrong: torch.distributed's own all-reduce, which the exercise asks to build."""

import torch.distributed as dist


def ring_all_reduce(t, group):
    dist.all_reduce(t, group=group.pg)
    return t


def bytes_sent_per_rank(S, N):
    return 2 * (N - 1) * S / N
