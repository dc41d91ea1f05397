"""Exercise 5.1, wrong: the contiguous cut (rank r: the r-th 1/cp of the sequence), which zigzag
exists to replace: every position once, and the last rank does the most causal work."""

import torch


def zigzag_positions(rank, cp, seq_len):
    return torch.arange(rank * seq_len // cp, (rank + 1) * seq_len // cp)
