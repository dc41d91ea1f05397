"""Collectives with a backward: the operators that make parallel layers differentiable.

Chapter 4's Megatron-LM operators and expert parallelism's dispatch. Each runs a collective in
forward and its conjugate in backward, so that autograd carries gradients across ranks:

    copy_to_parallel (f)        identity forward, all-reduce backward
    reduce_from_parallel (g)    all-reduce forward, identity backward
    sequence-parallel f and g   all-gather forward / reduce-scatter backward, and the reverse
    all_to_all_with_grad        an all-to-all forward, the reverse all-to-all backward

Every byte still goes through collectives.py, so the ledger counts both directions.
"""

from __future__ import annotations

import torch

from minipar.collectives import Group, all_gather, all_reduce, all_to_all, reduce_scatter

# ----------------------------------------------------------------------------------------------
# Autograd-aware operators (Megatron-LM's f and g, and their sequence-parallel versions).
#
# A column-parallel linear needs its input on every tp rank (forward: nothing to do) but each
# rank's backward only produces the input-gradient of its own output columns, so the gradients
# must be summed: identity forward, all-reduce backward ("f", copy_to_parallel). A row-parallel
# linear produces partial sums that must be added (forward all-reduce), while the gradient of a
# sum reaches every addend unchanged (identity backward): "g", reduce_from_parallel.
# ----------------------------------------------------------------------------------------------


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    # Each rank's gradient of the gathered sequence is partial (it saw only its own weight
    # shard), so backward must sum over ranks *and* split: a reduce-scatter.
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x.contiguous(), group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x.contiguous(), group, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


def copy_to_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return x if group.size == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return x if group.size == 1 else _ReduceFromParallel.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sequence parallelism's f: all-gather the sequence forward, reduce-scatter backward."""
    return x if group.size == 1 else _GatherFromSequenceParallel.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sequence parallelism's g: reduce-scatter the partial sums forward, all-gather backward."""
    return x if group.size == 1 else _ReduceScatterToSequenceParallel.apply(x, group, dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, send_splits, recv_splits):
        ctx.group, ctx.dim, ctx.splits = group, dim, (send_splits, recv_splits)
        return all_to_all(x, group, dim, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        # What came from rank j goes back to rank j: the same exchange with the splits swapped.
        return all_to_all(grad.contiguous(), ctx.group, ctx.dim, recv_splits, send_splits), None, None, None, None


def all_to_all_with_grad(x: torch.Tensor, group: Group, dim: int = 0, send_splits: list[int] | None = None,
                         recv_splits: list[int] | None = None) -> torch.Tensor:
    """collectives.all_to_all (uneven splits allowed) that autograd can differentiate."""
    return _AllToAll.apply(x, group, dim, send_splits, recv_splits)
