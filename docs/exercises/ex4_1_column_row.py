"""Exercise 4.1 (chapter 4): a column-parallel linear, then a row-parallel one (Megatron's MLP).

One device computes  y = tanh(x W1^T) W2^T  with W1 [h, d] and W2 [d, h]. At tensor parallelism N
rank r holds
    w1 = W1[r*h/N : (r+1)*h/N, :]     rows of W1: a block of the hidden features  (column-parallel)
    w2 = W2[:, r*h/N : (r+1)*h/N]     the matching columns of W2                  (row-parallel)
and the same x [b, d] as every other rank. Return y [b, d], the same on every rank, with
autograd giving every rank the right gradients: x.grad equal to one device's, w1.grad and w2.grad
equal to this rank's slices of one device's W1 and W2 gradients.

Two conjugate operators do it (chapter 4): f (identity forward, all-reduce of the gradient
backward) where the parallel region starts, g (all-reduce forward, identity backward) where it
ends. `minipar.autograd_ops` has both (`copy_to_parallel`, `reduce_from_parallel`); writing them
yourself as torch.autograd.Function with `minipar.collectives.all_reduce` is the longer exercise.

What the checker reads: the ledger must show one all-reduce of [b, d] in forward (g) and one in
backward (f's, of x's gradient), nothing else. The library's `ColumnParallelLinear`,
`RowParallelLinear` and `ParallelMLP` are switched off; `copy_to_parallel` and
`reduce_from_parallel` are yours to use.

The library's own, after you tried: `ColumnParallelLinear` and `RowParallelLinear` in
minipar/tensor_parallel.py, put together in `ParallelMLP` (minipar/tensor_parallel.py).

Check: make exercise N=4.1 (tp 2 and 4, a few seconds)
"""

import torch

from minipar.collectives import Group


def column_row_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, group: Group) -> torch.Tensor:
    """y = tanh(x W1^T) W2^T, from this rank's w1 [h/N, d] and w2 [d, h/N]."""
    raise NotImplementedError("hint: where does each rank need all of x's gradient, and where are "
                              "partial sums added? f on the way in, g on the way out")
