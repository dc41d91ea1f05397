"""Mixture-of-experts blocks on paper: what they keep for backward and what they send.

Chapter 8 for chapter 7's layers. Per MoE block and micro-batch a rank routes T tokens, each to k
of E experts; it sends `out` rows to experts on other ep ranks and its E/ep experts receive R:

    dropless (capacity_factor 0)   uniform routing's expectation: out = T*k*(ep-1)/ep, R = T*k;
                                   worst=True bounds them for any router
    capacity c > 0                 cap' = min(ceil(c*T*k/E), T) a rank and expert: out =
                                   (E - E/ep)*cap', R = E*cap', exact once every expert fills
"""

from __future__ import annotations

import math

from minipar.collectives import ring_bytes_sent
from minipar.layout import Layout
from minipar.model import ModelConfig
from minipar.precision import of_config

INDEX = 8  # int64 indices


def stream_and_product_widths(cfg: Layout) -> tuple[int, int]:
    """(the weights' and stream's width, the products'): bf16 autocast, fp32 and bf16; bf16-mixed, bf16 both."""
    p = of_config(cfg)  # bf16-mixed: bf16 weights and products
    return p.working.itemsize, p.activation_width


def routed_tokens(c: ModelConfig, cfg: Layout) -> int:
    """T: the tokens of one micro-batch that this rank routes (its cp share; its tp share under sp)."""
    return cfg.micro_batch * cfg.seq_len // cfg.cp // (cfg.tp if cfg.sp else 1)


def expert_rows(c: ModelConfig, cfg: Layout, worst: bool = False) -> tuple[int, int, int, int]:
    """(A kept assignments, rows sent out, rows received, R rows its experts run): the module's formulas."""
    t, k, e, ep = routed_tokens(c, cfg), c.top_k, c.n_experts, cfg.ep
    if c.capacity_factor > 0:
        cap = min(math.ceil(c.capacity_factor * (t * k) / e), t)  # as MoE.within_capacity computes it
        return e * cap, (e - e // ep) * cap, (ep - 1) * (e // ep) * cap, e * cap
    if worst:
        return t * k, t * min(k, e - e // ep), (ep - 1) * t * min(k, e // ep), ep * t * min(k, e // ep)
    return t * k, t * k * (ep - 1) // ep, t * k * (ep - 1) // ep, t * k


def moe_block_bytes(c: ModelConfig, cfg: Layout, worst: bool = False) -> int:
    """The MoE part of a block's activations for one micro-batch (chapter 8 lists its tensors), in bytes."""
    p, w = stream_and_product_widths(cfg)  # the router works in at least fp32: the weights' width
    t, k, e, d = routed_tokens(c, cfg), c.top_k, c.n_experts, c.dim
    kept, _, _, rows = expert_rows(c, cfg, worst)
    router = t * e * p + t * k * INDEX + t * k * p + t * p + t * k * w
    dispatch = kept * INDEX + rows * d * w + (2 * rows * INDEX if cfg.ep > 1 else 0)
    experts = 4 * rows * c.expert_ffn_dim * w + 4 * t * c.n_shared_experts * c.expert_ffn_dim * w
    combine = t * k * INDEX + t * k * d * w
    aux = t * p + e * p if c.aux_loss_coef else 0  # the row sums; the load shares that weigh P_i
    return router + dispatch + experts + combine + aux


def moe_messages(c: ModelConfig, cfg: Layout, worst: bool = False) -> list[tuple[str, int]]:
    """The messages a rank sends for one MoE block and micro-batch: ep's all-to-alls, the aux loss's
    all-reduces over cp (and tp under sp); dropless: uniform routing's (worst: its bound). Replays again."""
    stream, product = stream_and_product_widths(cfg)
    forward, backward = [], []
    if cfg.ep > 1:  # forward: the counts, tokens out (the normed stream's width), results back (products);
        _, out, back, _ = expert_rows(c, cfg, worst)  # backward: the results' gradients out, the tokens' back
        forward = [("ep/all_to_all", n) for n in ((c.n_experts - c.n_experts // cfg.ep) * INDEX,
                                                  c.dim * out * stream, c.dim * back * product)]
        backward = [("ep/all_to_all", c.dim * out * product), ("ep/all_to_all", c.dim * back * stream)]
    if c.aux_loss_coef:  # the probabilities' and the counts' sums, in the router's width
        for name, size in (("cp", cfg.cp), ("tp", cfg.tp if cfg.sp else 1)):
            forward += [(f"{name}/all_reduce", ring_bytes_sent("all_reduce", c.n_experts * stream, size))] * 2
    return forward * (2 if cfg.recompute or cfg.recompute_mlp else 1) + backward
