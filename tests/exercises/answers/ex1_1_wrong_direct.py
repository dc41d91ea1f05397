"""Exercise 1.1, wrong (issue 40's walk-around): each rank sends chunk j straight to rank j, which
sums what arrives, then sends its sum straight to every rank. The sum is right, and so are the bytes
(2(N-1)/N * S) and the count (2(N-1) messages): but it is not a ring. Each rank talks to every other
(N-1 peers, not one neighbour), so on a real network its sends share the links a ring keeps apart."""

import torch

from minipar.collectives import irecv, isend


def _exchange(sends, recvs, group):
    handles = [isend(t, group, j) for j, t in sends] + [irecv(t, group, j) for j, t in recvs]
    for h in handles:
        h.wait()


def ring_all_reduce(t, group):
    n, r = group.size, group.rank
    chunks = list(t.clone().tensor_split(n))
    arrived = {j: torch.empty_like(chunks[r]) for j in range(n) if j != r}
    _exchange([(j, chunks[j]) for j in range(n) if j != r], list(arrived.items()), group)  # chunk j to rank j
    chunks[r] = chunks[r] + sum(arrived.values())
    _exchange([(j, chunks[r]) for j in range(n) if j != r], [(j, chunks[j]) for j in range(n) if j != r], group)
    return torch.cat(chunks)


def bytes_sent_per_rank(S, N):
    return 2 * (N - 1) * S / N
