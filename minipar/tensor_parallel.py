"""Tensor parallelism: each weight matrix split across the tp ranks (Megatron-LM's layers).

Chapter 4 of the course (docs/04_tensor_parallel.md derives all of it). A linear layer Y = X A
can be cut two ways, and chained column then row the slice one produces is the slice the other
needs: one all-reduce per region forward (g, after the row layer) and one backward (f, entering):

    Column-parallel: A split by output columns      Row-parallel: A split by input rows
         X        [A0 | A1]      [Y0 | Y1]                [X0 | X1]    [A0]       Y0 + Y1
      [b,s,h] x  [h, o/tp] each = [b,s,o/tp] each       [b,s,i/tp] x  [A1]  =  all-reduce -> Y

The MLP is one region, attention (whole heads a rank: `ParallelAttention`) the other; q, k, v (and
gate, up) enter once (`project_after_f`, or `project_overlapped` under --tp-overlap). Sequence
parallelism (`sequence_parallel=True`) shards the norms' tokens between the regions: f becomes an
all-gather and g a reduce-scatter, the same bytes. The vocabulary is split too
(`VocabParallelEmbedding`, the column-parallel head and `vocab_parallel_cross_entropy`, padded to
a multiple of tp), so the [b, s, V] logits never exist on one rank. `shard` and `unshard` turn a
single-device tensor into this rank's piece and back, as each parameter's `Placement` says.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from minipar.autograd_ops import (
    copy_to_parallel,
    gather_from_sequence_parallel,
    overlapped_columns,
    reduce_from_parallel,
    reduce_scatter_to_sequence_parallel,
)
from minipar.collectives import Group, all_gather, all_reduce, ring_bytes_sent
from minipar.mesh import Groups
from minipar.model import Attention, ModelConfig, ModelError, apply_rope, rope_cos_sin
from minipar.placement import Placement, place, placement_of
from minipar.placement import sync_partial_grads as sync_partial_grads  # its home: where a gradient says it is partial

SEQ_DIM = 1  # activations are [batch, seq, hidden]


def check_tensor_layout(n_heads: int, n_kv_heads: int, dim: int, ffn_dim: int, tp: int,
                        sequence_parallel: bool, seq_len: int, cp: int = 1) -> None:
    """Raise ValueError, with the fix, if the model cannot be split tp ways (ModelError: its shape)."""
    if n_heads % tp:
        raise ModelError(f"--tp {tp} does not divide the model's {n_heads} attention heads: choose a divisor")
    if n_kv_heads % tp and tp % n_kv_heads:
        raise ModelError(f"--tp {tp} and the model's {n_kv_heads} kv heads: one must divide the other")
    for name, size in (("hidden size", dim), ("MLP size", ffn_dim)):
        if size % tp:
            raise ModelError(f"--tp {tp} does not divide the model's {name} {size}: choose a divisor")
    if sequence_parallel and tp == 1:
        raise ValueError("--sp needs --tp > 1: sequence parallelism shards the sequence across tp ranks")
    if sequence_parallel and (seq_len // cp) % tp:  # a cp rank's share of the sequence (context_parallel)
        raise ValueError(f"--sp: each rank's {seq_len // cp} tokens (--seq-len {seq_len} / --cp {cp}) do not split "
                         f"over --tp {tp}: choose a --seq-len divisible by {cp * tp}")


# ----------------------------------------------------------------------------------------------
# Sharding a single-device tensor, and back
# ----------------------------------------------------------------------------------------------


def mark(p: nn.Parameter, full_shape, dim: int | None = None, partial_grad: bool = False) -> nn.Parameter:
    """State p's tensor-parallel placement: split along `dim` over tp (None: every tp rank holds
    all of it), and whether each rank's gradient is only part of the sum over tp."""
    return place(p, Placement(tuple(full_shape), shards=(("tp", dim),) if dim is not None else (),
                              partial=("tp",) if partial_grad else ()))


def shard(full: torch.Tensor, p: nn.Parameter, groups: Groups | Group) -> torch.Tensor:
    """This rank's piece of a single-device tensor, cut along each mesh dimension that shards p
    (groups: the mesh's Groups, or the tp group alone), padded with zeros to a multiple of tp."""
    index, pad = piece_of(tuple(full.shape), p, groups)
    return padded(full[index], pad)


def piece_of(full_shape: tuple, p: nn.Parameter, groups: Groups | Group) -> tuple[tuple[slice, ...], dict[int, int]]:
    """Where `shard` cuts: this rank's index into a tensor of `full_shape`, and the zero rows to
    add along each cut dimension (the last tp rank's share of rows that do not divide). A reader
    of a file cuts there too, reading only its piece (run/checkpoint.py)."""
    groups = groups if isinstance(groups, Groups) else Groups(tp=groups)
    index, pad = [slice(None)] * len(full_shape), {}
    for mesh_dim, dim in placement_of(p).shards:  # distinct tensor dimensions
        local = p.shape[dim]
        start = min(groups[mesh_dim].rank * local, full_shape[dim])
        index[dim] = slice(start, min(start + local, full_shape[dim]))
        pad[dim] = local - (index[dim].stop - start)
    return tuple(index), pad


def padded(piece: torch.Tensor, pad: dict[int, int]) -> torch.Tensor:
    for dim, rows in pad.items():
        if rows:
            piece = torch.cat([piece, piece.new_zeros(*piece.shape[:dim], rows, *piece.shape[dim + 1:])], dim=dim)
    return piece


def unshard(local: torch.Tensor, p: nn.Parameter, groups: Groups | Group) -> torch.Tensor:
    """The single-device tensor, gathered from every rank's piece (groups: as for `shard`)."""
    groups = groups if isinstance(groups, Groups) else Groups(tp=groups)
    placement = placement_of(p)
    for mesh_dim, dim in reversed(placement.shards):
        local = all_gather(local.contiguous(), groups[mesh_dim], dim=dim).narrow(dim, 0, placement.full_shape[dim])
    return local


def enter_parallel_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """f: make the full input available to every tp rank (once per attention, MLP or LM head)."""
    return gather_from_sequence_parallel(x, group, SEQ_DIM) if sequence_parallel else copy_to_parallel(x, group)


def project_after_f(x: torch.Tensor, layers, group: Group, sequence_parallel: bool) -> list[torch.Tensor]:
    """A region's column layers on their one input, blocking (the lesson's order): f, then each layer.
    f's backward sends the input gradient once autograd has run every layer's backward, and waits."""
    x = enter_parallel_region(x, group, sequence_parallel)  # f: [b, s, in] on every rank
    return [F.linear(x, layer.weight if layer.rows is None else layer.weight[layer.rows], layer.bias)
            for layer in layers]  # [b, s, out_i/tp] each


def project_overlapped(x: torch.Tensor, layers, group: Group, sequence_parallel: bool) -> list[torch.Tensor]:
    """The same outputs and gradients, bitwise, from one autograd node that sends f's message while
    it computes the layers' weight gradients (autograd_ops.overlapped_columns; `--tp-overlap`)."""
    return list(overlapped_columns(x, group, sequence_parallel, [(m.weight, m.rows, m.bias) for m in layers]))


def leave_parallel_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """g: add up the ranks' partial sums (and, with sequence parallelism, keep this rank's slice)."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel(x, group, SEQ_DIM)
    return reduce_from_parallel(x, group)


def region_messages(stream: int, product: int, tp: int, sequence_parallel: bool) -> list[tuple[str, int]]:
    """The messages a region sends for a micro-batch, forward and backward, as (the ledger's "tp/op" key,
    bytes sent): f's of its input (`stream` bytes) and g's of its output (`product` bytes), an all-reduce
    each, or under sp an all-gather and a reduce-scatter each. The planner asks here (planning/traffic.py)."""
    ops = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
    return [(f"tp/{op}", ring_bytes_sent(op, n, tp)) for op in ops for n in (stream, product)]


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r: this rank's block of output features. Every rank needs all of X: f on entry (`project`)."""

    rows = None  # every row of the weight is used (ReplicatedRowsLinear: some)

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 sequence_parallel: bool = False, project=project_after_f):
        super().__init__()
        self.group, self.sequence_parallel, self.project = group, sequence_parallel, project
        local = math.ceil(out_features / group.size)  # padded when tp does not divide (vocabulary)
        self.weight = mark(nn.Parameter(torch.empty(local, in_features)), (out_features, in_features), dim=0)
        self.bias = mark(nn.Parameter(torch.zeros(local)), (out_features,), dim=0) if bias else None

    def forward(self, x):  # f, then this rank's columns: [b, s, out/tp]
        return self.project(x, (self,), self.group, self.sequence_parallel)[0]


class ColumnParallelLinearInRegion(ColumnParallelLinear):
    """A column-parallel layer whose caller has entered the region (f) once for all the layers that
    read this input (q, k and v; gate and up): one all-reduce of its gradient, not one per layer."""

    def forward(self, x):  # x: [b, s, in], already whole on every rank
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r: the input arrives split by features; partial sums are added (g)."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 sequence_parallel: bool = False):
        super().__init__()
        if in_features % group.size:
            raise ValueError(f"RowParallelLinear: {in_features} input features do not split over {group.size} ranks")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = mark(nn.Parameter(torch.empty(out_features, in_features // group.size)),
                           (out_features, in_features), dim=1)
        # The bias is added once, after the sum, so it is replicated.
        self.bias = mark(nn.Parameter(torch.zeros(out_features)), (out_features,),
                         partial_grad=sequence_parallel and group.size > 1) if bias else None

    def forward(self, x):
        y = leave_parallel_region(F.linear(x, self.weight), self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


class ReplicatedRowsLinear(nn.Module):
    """A linear whose full weight every tp rank holds but uses only some output rows of: with fewer
    kv heads than tp ranks, the one kv head this rank's query heads read. Its gradient is then a
    partial sum (nonzero only in the rows this rank used), all-reduced over tp after backward."""

    bias = None

    def __init__(self, in_features: int, out_features: int, group: Group, rows: slice):
        super().__init__()
        self.rows = rows
        self.weight = mark(nn.Parameter(torch.empty(out_features, in_features)), (out_features, in_features),
                           partial_grad=group.size > 1)

    def forward(self, x):
        return F.linear(x, self.weight[self.rows])


class VocabParallelEmbedding(nn.Module):
    """Rows [r*V/tp, (r+1)*V/tp) of the table on rank r; partial embeddings summed over tp."""

    def __init__(self, vocab_size: int, dim: int, group: Group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.rows = math.ceil(vocab_size / group.size)
        self.first = group.rank * self.rows
        self.weight = mark(nn.Parameter(torch.empty(self.rows, dim)), (vocab_size, dim), dim=0)

    def forward(self, ids):
        outside = (ids < self.first) | (ids >= self.first + self.rows)
        x = F.embedding((ids - self.first).masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, d], zeros where another rank owns the id
        return leave_parallel_region(x, self.group, self.sequence_parallel)


# ----------------------------------------------------------------------------------------------
# The attention and the MLP of one tp rank, cut from the plain ones
# ----------------------------------------------------------------------------------------------


def cut(plain: nn.Module, layer: nn.Module, tp: Group) -> nn.Module:
    """`layer`, a parallel layer, on plain's device and dtype, holding this rank's shard of plain's weight."""
    layer = layer.to(device=plain.weight.device, dtype=plain.weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(shard(plain.weight.detach(), layer.weight, tp))
    return layer


class ParallelMLP(nn.Module):
    """model.MLP on one tp rank: w_gate and w_up column-parallel (ffn/tp features each, one f for
    both), w_down row-parallel (g)."""

    def __init__(self, plain: nn.Module, tp: Group, sp: bool, project=project_after_f):
        super().__init__()
        ffn, dim = plain.w_gate.weight.shape
        self.w_gate = cut(plain.w_gate, ColumnParallelLinearInRegion(dim, ffn, tp), tp)
        self.w_up = cut(plain.w_up, ColumnParallelLinearInRegion(dim, ffn, tp), tp)
        self.w_down = cut(plain.w_down, RowParallelLinear(ffn, dim, tp, sequence_parallel=sp), tp)
        self.tp, self.sp, self.project = tp, sp, project

    def forward(self, x):  # [b, s, d], with sp [b, s/tp, d]
        gate, up = self.project(x, (self.w_gate, self.w_up), self.tp, self.sp)  # f, then both: [b, s, ffn/tp]
        return self.w_down(F.silu(gate) * up)  # w_down sums (g) -> [b, s, d]


class ParallelAttention(nn.Module):
    """model.Attention on one tp rank: its heads (wq, wk, wv column-parallel by whole heads, one f for
    the three; wo row-parallel, g). Its seams are the plain attention's, `attend` and `positions`: the
    ones context parallelism (context_parallel.install_context_parallel) and a KV cache swap."""

    def __init__(self, plain: Attention, config: ModelConfig, tp: Group, sp: bool, project=project_after_f):
        super().__init__()
        self.head_dim, self.rope_freqs, self.attend, self.positions = (plain.head_dim, plain.rope_freqs,
                                                                       plain.attend, plain.positions)
        self.tp, self.sp, self.project = tp, sp, project
        dim, q_features = config.dim, config.n_heads * config.head_dim
        self.wq = cut(plain.wq, ColumnParallelLinearInRegion(dim, q_features, tp), tp)
        self.wk = cut(plain.wk, _kv_projection(config, tp), tp)
        self.wv = cut(plain.wv, _kv_projection(config, tp), tp)
        self.wo = cut(plain.wo, RowParallelLinear(q_features, dim, tp, sequence_parallel=sp), tp)

    def forward(self, x):  # [b, s, d], with sp [b, s/tp, d]
        q, k, v = (rearrange(y, "b s (h d) -> b h s d", d=self.head_dim)  # f, once for q, k and v
                   for y in self.project(x, (self.wq, self.wk, self.wv), self.tp, self.sp))
        # q [b, h/tp, s, hd]; k, v [b, h_kv/tp (or 1), s, hd]: every token again under sp (f gathered them)
        cos, sin = rope_cos_sin(self.positions(q.shape[2], x.device), self.rope_freqs, x.dtype)
        out = self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # [b, h/tp, s, hd]
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))  # wo sums the heads' parts (g)


def _kv_projection(config: ModelConfig, tp: Group) -> nn.Module:
    """wk or wv for one tp rank: column-parallel when tp divides the kv heads, else the whole
    weight, of which this rank uses the one head its query heads read."""
    features = config.n_kv_heads * config.head_dim
    if config.n_kv_heads % tp.size == 0:
        return ColumnParallelLinearInRegion(config.dim, features, tp)
    head = tp.rank * config.n_kv_heads // tp.size
    return ReplicatedRowsLinear(config.dim, features, tp, slice(head * config.head_dim, (head + 1) * config.head_dim))


# ----------------------------------------------------------------------------------------------
# Cross-entropy from vocabulary-sharded logits
# ----------------------------------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, ignore_index, divisor):
        # logits [N, V/tp] (this rank's vocabulary block), targets [N] (global ids)
        local = logits.shape[-1]
        first = group.rank * local
        if first + local > vocab_size:  # this rank holds padding columns: they take no part in the softmax
            logits = logits.clone()
            logits[:, max(0, vocab_size - first):] = float("-inf")

        max_logit = logits.amax(dim=-1)
        all_reduce(max_logit, group, op="max")  # [N]: subtracted for a stable exp
        shifted = logits - max_logit.unsqueeze(-1)  # [N, V/tp]

        valid = targets != ignore_index
        mine = valid & (targets >= first) & (targets < first + local)
        local_target = (targets - first).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
        all_reduce(target_logit, group)  # [N]: only the owning rank contributed

        exp = shifted.exp_()  # in place: shifted is ours, and no longer needed
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)  # [N]

        count = valid.sum().clamp(min=1) if divisor is None else torch.tensor(divisor, device=logits.device)
        loss = ((sum_exp.log() - target_logit) * valid).sum() / count
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), mine, local_target, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logit_j = (softmax_j - [j == target]) / count, for every valid token.
        # A new tensor, not the saved softmax modified in place: a zero-bubble pipeline runs this
        # backward twice (input gradient, then weight gradient).
        softmax, mine, local_target, valid, count = ctx.saved_tensors
        scale = (valid.to(softmax.dtype) * grad_loss / count).unsqueeze(-1)  # [N, 1]
        grad = softmax * scale
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype) * scale)
        return grad, None, None, None, None, None


def loss_messages(tokens: int, width: int, tp: int) -> list[tuple[str, int]]:
    """What vocab_parallel_cross_entropy sends for `tokens` tokens: the max, the target's logit and the
    sum of exponentials, one all-reduce of a number per token each, at the logits' width or fp32's."""
    return [("tp/all_reduce", ring_bytes_sent("all_reduce", tokens * max(width, 4), tp))] * 3


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group, vocab_size: int,
                                 ignore_index: int = -100, divisor: float | None = None) -> torch.Tensor:
    """model.cross_entropy (their sum / divisor, by default their count) from logits [..., V/tp]."""
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), group, vocab_size,
                                            ignore_index, divisor)


def gather_logits(local: torch.Tensor, group: Group, vocab_size: int) -> torch.Tensor:
    """Full logits [..., V] from the shards: for tests and inspection, never used in training."""
    return all_gather(local.contiguous(), group, dim=-1)[..., :vocab_size]
