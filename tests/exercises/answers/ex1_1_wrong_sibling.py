"""Exercise 1.1, wrong: torch's all-reduce reached through torch.distributed.distributed_c10d, the
module that defines what torch.distributed re-exports."""

from torch.distributed import distributed_c10d


def ring_all_reduce(t, group):
    out = t.clone()
    distributed_c10d.all_reduce(out, group=group.pg)
    return out


def bytes_sent_per_rank(S, N):
    return 2 * (N - 1) * S / N
