"""Mixture of experts: the plain, single-device layer. Chapter 7, part one.

A dense block sends every token through one MLP. A mixture-of-experts (MoE) block holds E MLPs,
the experts, and a router that picks k of them for each token:

    probs   = softmax(router(x))  (or sigmoid)   [T, E], in at least float32
    chosen  = the k most probable experts        and their probabilities, renormalised to sum to 1
    y_t     = sum over t's k experts e of weight_te * expert_e(x_t)   (+ shared_expert(x_t))

Parameters grow with E, the work per token only with k. model.py knows none of this: this module
adds its block to the model's FEED_FORWARD. The assignments are sorted by expert (stable), so each
expert runs one contiguous run of tokens; `MoE.dispatch` is the seam expert_parallel.py replaces.
The load-balancing loss (Switch/GShard) reaches backward through the block's output
(`_AttachAuxLoss`), not the returned loss; `capacity_factor` > 0 drops what overflows an expert.
Read docs/07_expert_parallel.md: the layout of the work, the aux loss, capacity and dropping.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from minipar.model import FEED_FORWARD


class Experts(nn.Module):
    """E SwiGLU MLPs stored as three stacked tensors, expert first, so that a rank can hold a slice
    of them (expert parallelism cuts dim 0). The number of experts is read off the shapes."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w_up = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w_down = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: tokens grouped by expert, counts[e] of them for expert e (none is fine)."""
        out = [F.linear(F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e]), self.w_down[e])
               for e, xe in enumerate(x.split(counts))]
        return torch.cat(out)


def local_dispatch(x_sorted: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert is here: run each on its run of tokens."""
    return experts(x_sorted, counts.tolist())


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: y as it is. Backward: y's gradient, and `weight` as aux's, so that
    d(weight * aux)/d(router) joins the backward pass where the block is."""

    @staticmethod
    def forward(ctx, y, aux, weight):
        ctx.weight, ctx.like = weight, aux
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full_like(ctx.like, ctx.weight), None


class MoE(nn.Module):
    """Router, experts, optional shared expert. x [b, s, d] -> [b, s, d]."""

    def __init__(self, config):
        super().__init__()
        self.n_experts, self.top_k, self.router_kind = config.n_experts, config.top_k, config.router
        self.capacity_factor, self.aux_loss_coef = config.capacity_factor, config.aux_loss_coef
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = Experts(config.n_experts, config.dim, config.expert_ffn_dim)
        # A shared expert (DeepSeek) sees every token: one more expert, n_shared times as wide, never routed.
        self.shared = Experts(1, config.dim, config.n_shared_experts * config.expert_ffn_dim) \
            if config.n_shared_experts else None
        self.dispatch = local_dispatch  # expert parallelism swaps in the all-to-all version
        self.pool_tokens = whole_batch  # context/sequence parallelism: add the other ranks' sums
        self.aux_scale = 1.0  # this micro-batch's weight in the step: set by the training step
        self.aux_replicas = 1  # ranks whose gradients are averaged though they saw one sequence (cp)
        self.load = torch.zeros(config.n_experts, dtype=torch.long)  # assignments per expert, for the log
        self.counting = True  # False while a forward is replayed (see `replaying`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.top_k
        x = x.reshape(-1, shape[-1])  # [T, d]
        probs = self.probabilities(x)
        weights, chosen = probs.topk(k, dim=-1)  # [T, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = chosen.flatten()  # assignment a: token a // k, its (a % k)-th choice
        counts = torch.bincount(flat, minlength=self.n_experts)
        if self.counting:
            self.load += counts.detach().cpu()
        if self.capacity_factor > 0:  # dropped assignments become expert E: sorted last, never run
            flat = torch.where(self.within_capacity(flat), flat, self.n_experts)
        order = flat.argsort(stable=True)
        kept = torch.bincount(flat, minlength=self.n_experts)[: self.n_experts]
        y = self.dispatch(x[order[: int(kept.sum())] // k], kept, self.experts)
        y = torch.cat([y, y.new_zeros(len(order) - len(y), y.shape[1])])  # dropped ones add nothing
        y = y[order.argsort()].view(-1, k, shape[-1])  # back to assignment order
        y = (y * weights.unsqueeze(-1)).sum(1)
        if self.shared is not None:
            y = y + self.shared(x, [len(x)])
        if self.aux_loss_coef and torch.is_grad_enabled():
            aux = self.load_balance_loss(probs, counts)
            y = _AttachAuxLoss.apply(y, aux, self.aux_loss_coef * self.aux_scale * self.aux_replicas)
        return y.view(shape)

    @contextmanager
    def replaying(self):
        """Within it, forwards are replays of one already run (activation checkpointing rebuilds a
        layer's forward in backward): the same tokens, so they are not counted in `load` again."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Router probabilities [T, E] in at least float32 (a low-precision router flips choices)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.router.weight.to(dtype))
        return logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()

    def within_capacity(self, flat: torch.Tensor) -> torch.Tensor:
        """True for the assignments each expert takes: its first ceil(c * T * k / E), in token order."""
        capacity = math.ceil(self.capacity_factor * len(flat) / self.n_experts)
        one_hot = F.one_hot(flat, self.n_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # how many went to that expert before
        return position < capacity

    def load_balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """E * sum_i f_i * P_i over the micro-batch (pool_tokens adds what other ranks hold of it)."""
        p_sum = (probs / probs.sum(-1, keepdim=True)).sum(0)  # sigmoid scores normalised too
        p_sum, counts, tokens = self.pool_tokens(p_sum, counts.to(probs.dtype), len(probs))
        return self.n_experts * ((counts / (tokens * self.top_k)) * (p_sum / tokens)).sum()


FEED_FORWARD["moe"] = MoE  # the plain model builds one in each layer its config gives experts (model.Block)


def whole_batch(p_sum: torch.Tensor, counts: torch.Tensor, tokens: int):
    """On one device this rank holds every token of its micro-batch: nothing to add."""
    return p_sum, counts, tokens


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """Weigh each MoE block's auxiliary loss by `scale`: 1 / micro-batches per step, so that the
    step's gradient is that of the mean auxiliary loss over its micro-batches."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.aux_scale = scale


def take_load(model: nn.Module) -> list[list[int]]:
    """Assignments per expert in each MoE block since the last call (this rank's tokens), reset."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    loads = [m.load.tolist() for m in moes]
    for m in moes:
        m.load.zero_()
    return loads
