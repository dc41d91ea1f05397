"""Exercise 1.1, wrong: the library's own ring (minipar.collectives.ring_all_reduce) on a copy padded to
a multiple of N. Right result, right bytes, and nothing learnt: the checker switches it off."""

import torch

from minipar.collectives import ring_all_reduce as library_ring_all_reduce
from minipar.collectives import ring_bytes_sent


def ring_all_reduce(t, group):
    padded = torch.cat([t, t.new_zeros(-len(t) % group.size)])
    return library_ring_all_reduce(padded, group)[: len(t)]


def bytes_sent_per_rank(S, N):
    return ring_bytes_sent("all_reduce", S, N)
