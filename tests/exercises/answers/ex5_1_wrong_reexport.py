"""Exercise 5.1, wrong (issue 40's walk-around): the library's split_sequence through its re-export
in minipar.run.step, on the positions."""

import torch

from minipar.run.step import split_sequence


class _Group:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def zigzag_positions(rank, cp, seq_len):
    return split_sequence(torch.arange(seq_len).view(1, -1), _Group(rank, cp)).view(-1)
