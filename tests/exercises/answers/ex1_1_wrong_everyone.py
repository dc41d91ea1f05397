"""Exercise 1.1, wrong: every rank sends its whole tensor to every other rank and adds what arrives.
The sum is right; the traffic is (N-1) * S per rank, not the ring's 2(N-1)/N * S, in N-1 messages."""

import torch

from minipar.collectives import irecv, isend


def ring_all_reduce(t, group):
    n, r = group.size, group.rank
    incoming = [torch.empty_like(t) for _ in range(n)]
    handles = [isend(t, group, j) for j in range(n) if j != r]
    handles += [irecv(incoming[j], group, j) for j in range(n) if j != r]
    for h in handles:
        h.wait()
    return t + sum(incoming[j] for j in range(n) if j != r)


def bytes_sent_per_rank(S, N):
    return 2 * (N - 1) * S / N
