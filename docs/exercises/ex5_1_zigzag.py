"""Exercise 5.1 (chapter 5): zigzag chunk assignment for context parallelism.

Ring attention cuts the sequence across cp ranks. With a causal mask token t attends to t+1 keys,
so a contiguous cut gives the last rank the most work. The zigzag cut: split the sequence into
2*cp equal chunks and give rank i chunk i and chunk 2*cp-1-i, one early and one late.

Return the global positions of the tokens that `rank` holds, in order (its first chunk, then its
second). Every position must belong to exactly one rank, and every rank must do the same causal
work (the sum over its tokens of t+1).

The library's `zigzag_positions` and `split_sequence` are switched off while the checker runs.

The library's own, after you tried: `zigzag_positions` in minipar/context_parallel.py.

Check: make exercise N=5.1 (no ranks needed, a second)
"""

import torch


def zigzag_positions(rank: int, cp: int, seq_len: int) -> torch.Tensor:
    """The positions (int64, [seq_len / cp]) of rank `rank`'s tokens; seq_len divides by 2*cp."""
    raise NotImplementedError("hint: chunk length c = seq_len // (2 * cp); torch.arange for each chunk, then cat")
