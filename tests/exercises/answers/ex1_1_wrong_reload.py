"""Exercise 1.1, wrong: the library's ring from a fresh copy of the module (importlib.reload): its functions are
new objects, which the old switch-off, one module attribute, did not reach (issue 40)."""

import importlib

import torch

import minipar.collectives

library_ring_all_reduce = importlib.reload(minipar.collectives).ring_all_reduce


def ring_all_reduce(t, group):
    padded = torch.cat([t, t.new_zeros(-len(t) % group.size)])
    return library_ring_all_reduce(padded, group)[: len(t)]


def bytes_sent_per_rank(S, N):
    return 2 * (N - 1) * S / N
