"""Exercise 5.1, wrong: the library's split_sequence (what cuts the tokens for ring attention) on the
positions, with a stand-in group: the checker switches it off."""

from types import SimpleNamespace

import torch

from minipar.context_parallel import split_sequence


def zigzag_positions(rank, cp, seq_len):
    return split_sequence(torch.arange(seq_len), SimpleNamespace(size=cp, rank=rank), dim=0)
