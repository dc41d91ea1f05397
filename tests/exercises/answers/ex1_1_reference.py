"""Exercise 1.1, the library's answer: minipar.collectives.ring_all_reduce, on a copy padded with
zeros to a multiple of N (the library's ring takes only lengths that N divides)."""

import torch

from minipar.collectives import ring_all_reduce as library_ring_all_reduce
from minipar.collectives import ring_bytes_sent


def ring_all_reduce(t, group):
    padded = torch.cat([t, t.new_zeros(-len(t) % group.size)])
    return library_ring_all_reduce(padded, group)[: len(t)]


def bytes_sent_per_rank(S, N):
    return ring_bytes_sent("all_reduce", S, N)
