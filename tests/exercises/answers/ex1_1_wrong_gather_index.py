"""Exercise 1.1, wrong: an off-by-one in the all-gather: each rank passes on chunk (r - k), not the
one it just finished, (r + 1 - k), so a stale partial sum goes round the ring."""

import torch

from minipar.collectives import send_recv


def _hop(send_t, like, group):
    n, r = group.size, group.rank
    incoming = torch.empty_like(like)
    for handle in send_recv(send_t, (r + 1) % n, incoming, (r - 1) % n, group):
        handle.wait()
    return incoming


def ring_all_reduce(t, group):
    n, r = group.size, group.rank
    chunks = list(t.clone().tensor_split(n))
    for k in range(n - 1):
        dst = (r - k - 1) % n
        chunks[dst] = chunks[dst] + _hop(chunks[(r - k) % n], chunks[dst], group)
    for k in range(n - 1):
        dst = (r - k) % n
        chunks[dst] = _hop(chunks[(r - k) % n], chunks[dst], group)
    return torch.cat(chunks)


def bytes_sent_per_rank(S, N):
    return 2 * (N - 1) * S / N
