"""Collectives with a backward: the operators that make parallel layers differentiable.

Chapter 4's Megatron-LM operators and expert parallelism's dispatch. Each runs a collective in
forward and its conjugate in backward, so that autograd carries gradients across ranks:

    copy_to_parallel (f)        identity forward, all-reduce backward
    reduce_from_parallel (g)    all-reduce forward, identity backward
    sequence-parallel f and g   all-gather forward / reduce-scatter backward, and the reverse
    overlapped_columns          f and the column layers after it in one node: f's backward message
                                travels while the weight gradients are computed
    all_to_all_with_grad        an all-to-all forward, the reverse all-to-all backward

Why these pairs: a column-parallel linear needs its input on every tp rank (forward: nothing to
do), but each rank's backward only produces the input-gradient of its own output columns, so the
gradients must be summed (f). A row-parallel linear produces partial sums that must be added
(forward all-reduce), while the gradient of a sum reaches every addend unchanged (g). Every byte
still goes through collectives.py, so the ledger counts both directions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minipar.collectives import Group, all_gather, all_gather_into, all_reduce, all_to_all, reduce_scatter


class _Conjugate(torch.autograd.Function):
    """`forward_op(x)` in forward, `backward_op(grad)` in backward: each operator but the overlapped one."""

    @staticmethod
    def forward(ctx, x, forward_op, backward_op):
        ctx.backward_op = backward_op
        return forward_op(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad), None, None


def _summed(t: torch.Tensor, group: Group) -> torch.Tensor:
    t = t.contiguous().clone()
    all_reduce(t, group)
    return t


def copy_to_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return x if group.size == 1 else _Conjugate.apply(x, lambda t: t, lambda t: _summed(t, group))


def reduce_from_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return x if group.size == 1 else _Conjugate.apply(x, lambda t: _summed(t, group), lambda t: t)


def gather_from_sequence_parallel(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sequence parallelism's f: all-gather the sequence forward, reduce-scatter backward (each
    rank's gradient of the gathered sequence is partial: it saw only its own weight shard)."""
    return x if group.size == 1 else _Conjugate.apply(x, lambda t: all_gather(t.contiguous(), group, dim=dim),
                                                       lambda t: reduce_scatter(t.contiguous(), group, dim=dim))


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sequence parallelism's g: reduce-scatter the partial sums forward, all-gather backward."""
    return x if group.size == 1 else _Conjugate.apply(x, lambda t: reduce_scatter(t.contiguous(), group, dim=dim),
                                                       lambda t: all_gather(t.contiguous(), group, dim=dim))


# ----------------------------------------------------------------------------------------------
# f with its column layers, overlapped (Megatron-LM's asynchronous input-gradient all-reduce).
#
# Above, f is a node of its own: autograd runs every column layer's backward (dX_i and dW_i
# together), adds the dX_i, and only then reaches f, which sends and waits. Here f and the layers
# that read its input are one node, so its backward can order the work itself:
#
#     sp: post the all-gather of x again     forward kept only this rank's [b, s/tp, h] of x
#     dX = sum_i dY_i W_i                    does not need x: the gather travels meanwhile
#     post the all-reduce of dX              sp: its reduce-scatter
#     dW_i = dY_iᵀ x for every layer         nothing waits for these: the message travels meanwhile
#     wait
#
# The matmuls are autograd's own for F.linear (the same ops on the same layouts), and dX adds the
# layers' parts in autograd's order (the last layer's first), so both paths agree bitwise. Under
# autocast the matmuls run in dY's dtype and each gradient returns in its input's dtype, as there.
# ----------------------------------------------------------------------------------------------


class _OverlappedColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sp, rows, *params):  # params: weight, bias (or None) of each layer
        ctx.group, ctx.sp, ctx.rows = group, sp, rows
        ctx.save_for_backward(x, *params)  # sp: only this rank's shard of x, [b, s/tp, h]
        whole = all_gather(x.contiguous(), group, dim=1) if sp else x  # [b, s, h]
        return tuple(F.linear(whole, w if r is None else w[r], b) for w, b, r in zip(params[::2], params[1::2], rows))

    @staticmethod
    def backward(ctx, *dys):
        x, *params = ctx.saved_tensors
        group, weights, rows = ctx.group, params[::2], ctx.rows
        if ctx.sp:  # x whole again, into [tp, b, s/tp, h], while dX is computed
            pieces = x.new_empty((group.size, *x.shape))
            gathering = all_gather_into(pieces.view(-1), x.reshape(-1), group, async_op=True)
        dys = [dy.reshape(-1, dy.shape[-1]) for dy in dys]  # [b s, out_i/tp]
        parts = [dy.mm((w if r is None else w[r]).to(dy.dtype)).to(x.dtype)  # [b s, h] each
                 for dy, w, r in reversed(list(zip(dys, weights, rows)))]  # the last layer's part first, as autograd
        dx = sum(parts[1:], parts[0])
        if ctx.sp:
            gathering.wait()
            x = pieces.movedim(0, 1).flatten(1, 2)  # [b, s, h], as the forward's all-gather made it
            dx, sending = reduce_scatter(dx.view(x.shape), group, dim=1, async_op=True)  # [b, s/tp, h]
        else:
            dx = dx.view(x.shape)
            sending = all_reduce(dx, group, async_op=True)
        xs = x.reshape(-1, x.shape[-1]).to(dys[0].dtype)  # [b s, h]
        grads = []
        for dy, w, b, r in zip(dys, weights, params[1::2], rows):  # while the message travels
            dw = dy.t().mm(xs).to(w.dtype)  # [out_i/tp, h]
            if r is not None:  # a ReplicatedRowsLinear: only its rows of the shared weight have a gradient
                dw = torch.zeros_like(w).slice_scatter(dw, 0, r.start, r.stop)  # [out, h]
            grads += [dw, None if b is None else dy.sum(0).to(b.dtype)]
        if sending is not None:
            sending.wait()
        return dx, None, None, None, *grads


def overlapped_columns(x: torch.Tensor, group: Group, sp: bool, layers) -> tuple[torch.Tensor, ...]:
    """f, then F.linear(x, weight[rows], bias) for each (weight, rows, bias) of `layers` (rows: None
    for all of them), as one autograd node whose backward hides f's message behind the weight
    gradients. The outputs and every gradient equal f's then the layers', bitwise."""
    rows = tuple(r for _, r, _ in layers)
    return _OverlappedColumns.apply(x, group, sp, rows, *(t for w, _, b in layers for t in (w, b)))


def all_to_all_with_grad(x: torch.Tensor, group: Group, dim: int = 0, send_splits: list[int] | None = None,
                         recv_splits: list[int] | None = None) -> torch.Tensor:
    """collectives.all_to_all (uneven splits allowed) that autograd can differentiate. What came from
    rank j goes back to rank j: its backward is the same exchange with the splits swapped."""
    return _Conjugate.apply(x, lambda t: all_to_all(t, group, dim, send_splits, recv_splits),
                            lambda t: all_to_all(t.contiguous(), group, dim, recv_splits, send_splits))
