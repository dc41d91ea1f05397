"""What each rank will hold, worked out before anything runs (chapter 8).

The rank's part of the model is built *on paper* (meta device, cut by training's own `parallelize`,
ZeRO's buckets from `bucket_plan`), so the estimate follows the code; tests/test_estimate.py checks it
byte for byte against `GradSync.held_bytes()`: params and grads (whole, data parallelism's buffers,
ZeRO's slices), optimizer (AdamW's two moments, Muon's one buffer), activations (what autograd keeps,
per micro-batch a schedule keeps) and temporary (ZeRO's buffers of a moment).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import lru_cache
from types import SimpleNamespace

import torch

from minipar.data_parallel import bucket_params, param_groups
from minipar.layout import Layout, paper_group
from minipar.model import Llama, ModelConfig
from minipar.muon import muon_ids, split_groups
from minipar.parallelize import parallelize
from minipar.pipeline.executor import Pipeline, stage_layers
from minipar.pipeline.schedules import build as build_schedule
from minipar.placement import DENSE, placement_of
from minipar.planning.estimate_moe import moe_block_bytes
from minipar.planning.estimate_zeropp import secondary_bytes
from minipar.precision import of_config, widths
from minipar.zero import bucket_plan, kept_whole, packed
from minipar.zero3 import unit_chunks, units_of


def rank_model(model_cfg: ModelConfig, cfg: Layout, pp_rank: int = 0) -> Llama:
    """The part of the model that pp rank `pp_rank` holds under cfg's layout, on the meta device.
    Every tp (and ep) rank holds pieces of the same shapes, so their index does not matter."""
    layers, first, last = list(range(model_cfg.n_layers)), True, True
    if cfg.pp > 1:
        pipeline = Pipeline(paper_group("pp", cfg.pp, pp_rank), cfg.schedule, model_cfg.n_layers, cfg.virtual_stages,
                            layer_counts=cfg.stage_counts)
        layers, first, last = pipeline.my_layers(), pipeline.holds_first(), pipeline.holds_last()
    if not model_cfg.n_experts:  # dense layers are all alike: build only as many as the rank holds
        model_cfg, layers = replace(model_cfg, n_layers=len(layers)), list(range(len(layers)))
    return _model_on_paper(model_cfg, tuple(layers), first, last, cfg.tp, cfg.sp, cfg.ep, of_config(cfg).built)


@lru_cache(maxsize=64)  # the planner asks for the same stage under many ZeRO stages and dp sizes
def _model_on_paper(model_cfg: ModelConfig, layers: tuple, first: bool, last: bool, tp: int, sp: bool, ep: int,
                    dtype: torch.dtype) -> Llama:
    with torch.device("meta"):  # the layers parallelize swaps in are made on paper too
        model = parallelize(Llama(model_cfg, seed=0), tp=paper_group("tp", tp), sp=sp,
                            stage=(list(layers), first, last), ep=paper_group("ep", ep))
    return model.to(dtype)  # as train.build_model (bf16-mixed: fp32 too): buckets are cut by bytes


def held_bytes(model_cfg: ModelConfig, cfg: Layout, pp_rank: int = 0) -> dict[str, int]:
    """{params, grads, optimizer}: the bytes pp rank `pp_rank` holds once gradients are synced.
    bf16-mixed (precision.py): bf16 weights and gradients, fp32 masters (counted with the params)."""
    model = rank_model(model_cfg, cfg, pp_rank)
    (prec, width, wire), params = widths(cfg), list(model.parameters())
    master, numel = torch.promote_types(prec.built, torch.float32).itemsize, sum(p.numel() for p in params)
    if cfg.zero == 0:  # every weight, its gradient, a flat all-reduce buffer if it has replicas, two moments
        buffers = sum(p.numel() for p in params if grad_replicas(placement_of(p).grad_mean, cfg) > 1) * wire
        muon = sum(p.numel() for p in params if id(p) in muon_ids(model)) if cfg.optimizer == "muon" else 0
        return {"params": numel * (width + master * prec.mixed), "grads": numel * width + buffers,
                "optimizer": (2 * numel - muon) * master}  # Muon: one momentum buffer, AdamW two moments
    plan = zero_buckets(model, cfg)
    sizes = [bucket_size(model, cfg, dims, chunk) // grad_replicas(dims, cfg) for _, dims, chunk in plan]
    slices, muon = sum(sizes), sum(s for s, (i, _, _) in zip(sizes, plan) if i == 0 and cfg.optimizer == "muon")
    padding = sum(s * grad_replicas(d, cfg) - sum(p.numel() for p in c) for s, (_, d, c) in zip(sizes, plan))
    weights = (numel + padding) * width if cfg.zero < 3 else slices * width * prec.mixed  # ZeRO-3: its bf16 shard
    weights += secondary_bytes(plan, cfg, width) if cfg.zero == 3 else 0  # ZeRO++'s hpZ (planning/estimate_zeropp.py)
    return {"params": weights + slices * master, "grads": slices * width, "optimizer": (2 * slices - muon) * master}


def grad_replicas(grad_mean: tuple[str, ...], cfg: Layout) -> int:
    """The size of the group a gradient is averaged over: dp x cp, or edp = dp x cp / ep."""
    return cfg.dp * cfg.cp if tuple(grad_mean) == DENSE else cfg.dp * cfg.cp // cfg.ep


def temporary_bytes(model_cfg: ModelConfig, cfg: Layout, pp_rank: int = 0) -> dict[str, int]:
    """ZeRO's buffers that come and go within a step, at their largest, beyond held_bytes: flattened
    (ZeRO 1-3), the largest bucket's gradients flat and padded for its reduce-scatter; gathered
    (ZeRO-3), the whole weights of the unit running and of the next one (prefetched)."""
    if cfg.zero == 0:
        return {}
    model, (_, width, wire) = rank_model(model_cfg, cfg, pp_rank), widths(cfg)
    plan = zero_buckets(model, cfg)
    padded = [bucket_size(model, cfg, d, c) * max(width, wire) for _, d, c in plan]
    if cfg.zero < 3:
        return {"flattened": max(padded)}
    unit_of, units = {id(p): i for i, unit in enumerate(units_of(model)) for p in unit.parameters()}, Counter()
    for size, (_, _, chunk) in zip(padded, plan):
        units[unit_of[id(chunk[0])]] += size
    return {"flattened": max(padded), "gathered": max(units[i] + units[i + 1] for i in range(len(units)))}


def zero_buckets(model, cfg: Layout):
    """ZeRO's buckets of the rank's model (zero.bucket_plan): ZeRO-3's units, else bucket_mb's chunks.
    Muon: its matrices' buckets first (group 0), apart from AdamW's (muon.muon_param_groups)."""
    return _zero_buckets(model, cfg.zero == 3, cfg.bucket_mb, cfg.weight_decay, cfg.optimizer == "muon")


@lru_cache(maxsize=256)  # a model on paper is asked again for each dp size and ZeRO stage the planner weighs
def _zero_buckets(model, units: bool, bucket_mb: float, weight_decay: float, muon: bool = False):
    chunks = (lambda ps: unit_chunks(units_of(model), ps)) if units else (lambda ps: bucket_params(ps, bucket_mb))
    groups = param_groups(model, SimpleNamespace(weight_decay=weight_decay))
    matrices, rest = split_groups(model, groups)
    return bucket_plan([{"params": matrices}, *rest] if muon else groups, chunks)


def bucket_size(model, cfg: Layout, dims, chunk) -> int:
    """A ZeRO bucket's flat size: padded to a multiple of its group; Muon's under --muon-method whole
    each slice padded to the largest run of whole matrices (zero.kept_whole)."""
    n, sizes = grad_replicas(dims, cfg), [p.numel() for p in chunk]
    whole = cfg.optimizer == "muon" and cfg.muon_method == "whole" and id(chunk[0]) in muon_ids(model)
    return (kept_whole if whole else packed)(sizes, n)[1]


# -- Activations: what backward needs, kept from forward --------------------------------------------


def layer_activation_bytes(c: ModelConfig, cfg: Layout) -> int:
    """The tensors one dense transformer layer keeps for backward, for one micro-batch: exactly what
    autograd saves in minipar's layer (tests/test_estimate.py counts them), Korthikanti et al.'s
    sbh(34 + 5as/h) worked out again for a Llama layer with attention that keeps no s x s matrix.
    Per token of the rank (s = seq_len / cp), in elements of the activation dtype:

        norms      x and x/rms of both norms (cut by tp under sp), and the normed inputs that the
                   projections keep (whole: minipar gathers them under sp)       6d, or 2d + 4d/tp
        attention  q after RoPE and the output before wo (d/tp each); k and v at the kv heads'
                   width, or at the query heads' once repeated for grouped-query attention; the
                   softmax's log-sum-exp per head                                ~4d/tp + h/tp
                   (Ulysses: the output also before it is reordered, + d/tp; two orders of s)
        MLP        gate, silu(gate), up and their product                       4 ffn/tp
        small      1/rms of both norms; RoPE's cos and sin tables (per sequence position)
    With --recompute a layer keeps only its input (and rebuilds the rest in backward); with --recompute-mlp
    the MLP its input (the normed stream as it arrives: d/tp under sp, fp32 under autocast), not 4 ffn/tp.
    With --tp-overlap a region keeps its input as it arrives (d/tp under sp), in no bf16 copy."""
    t, w, b = cfg.tp, of_config(cfg).activation_width, cfg.micro_batch
    s, d, e = cfg.seq_len // cfg.cp, c.dim, c.head_dim
    tokens, sp, overlap = b * s, (t if cfg.sp else 1), cfg.tp_overlap and t > 1
    if cfg.recompute:  # the layer's input: the residual stream, in the weights' dtype
        return tokens * d * widths(cfg)[1] // sp
    heads, kv = c.n_heads // t, max(1, c.n_kv_heads // t)
    if cfg.recompute_selective:
        return selective_layer_bytes(c, cfg, tokens, heads, kv)
    ulysses = cfg.cp > 1 and cfg.cp_attention == "ulysses"  # SDPA on h/cp heads; its output reordered for wo
    at_once = cfg.cp if ulysses else 1  # the heads SDPA sees: a tp rank's, or a cp rank's share of them
    repeated = (cfg.cp == 1 or ulysses) and 1 < kv // at_once < heads // at_once  # repeat copies; 1 head: a view
    attention = (2 + ulysses) * tokens * d // t + 2 * tokens * e * (heads if repeated else kv)
    orders = 16 * cfg.seq_len if ulysses else 0  # bytes: ulysses_attention's two int64 orders of the tokens
    small = 2 * tokens // sp + 2 * s * e + tokens * heads  # 1/rms, cos and sin, log-sum-exp
    mlp, r = (0 if cfg.recompute_mlp else 4 * tokens * c.ffn_dim // t), cfg.recompute_mlp
    if of_config(cfg).autocast is not None:  # autocast: x, x/rms and the small ones in fp32; a bf16 copy of the
        # normed input for each of the 5 projections that read it; the weights' copies: weight_casts.
        # SDPA's bf16 copy of the (fp32, rotated) keys is made from their repeated view: full width.
        # Ring attention keeps q, k and its output in fp32, v in bf16; wo reads a bf16 copy.
        qo, width_k, width_v = tokens * d // t, tokens * e * heads, tokens * e * (heads if repeated else kv)
        ring = cfg.cp > 1 and not ulysses
        attention_bytes = 10 * qo + 6 * tokens * e * kv if ring else 2 * ((2 + ulysses) * qo + width_k + width_v)
        inputs = 4 * (2 - r) * tokens * d // sp if overlap else 2 * (5 - 2 * r) * tokens * d  # overlap: fp32 as it came
        # --recompute-mlp: the MLP's input in fp32, and not the bf16 copies gate and up read
        return 4 * ((4 + r) * tokens * d // sp + small) + inputs + 2 * mlp + attention_bytes + orders
    inputs = (2 - r) * tokens * d // (sp if overlap else 1)  # what the projections keep of their normed inputs
    norms, lse = inputs + (4 + r) * tokens * d // sp, (max(w, 4) - w) * tokens * heads * (cfg.cp == 1 or ulysses)
    return w * (norms + attention + mlp + small) + orders + lse  # lse: SDPA keeps its log-sum-exp in fp32 at least


def selective_layer_bytes(c: ModelConfig, cfg: Layout, tokens: int, heads: int, kv: int) -> int:
    """--recompute-selective: a layer keeps its input (the residual stream as it arrives), the output of
    each of its seven matmuls and attention's output and log-sum-exp (parallelize.KEPT_OPS), nothing else:
    k and v at the kv heads' width (their repeat is redone), wo's and w_down's outputs whole (partial sums,
    before g). Per token: x d/sp, q, out d/tp, k, v e kv/tp each, wo, w_down d each, gate, up ffn/tp each.
    Ring attention (--cp) is one autograd node of its own, no op of the policy's: replayed whole, keeping
    neither its output nor its log-sum-exp."""
    t, sp, d, w = cfg.tp, (cfg.tp if cfg.sp else 1), c.dim, of_config(cfg).activation_width
    ring = cfg.cp > 1 and cfg.cp_attention == "ring"
    products = (2 - ring) * tokens * d // t + 2 * tokens * (c.head_dim * kv + d + c.ffn_dim // t)
    return widths(cfg)[1] * tokens * d // sp + w * products + (not ring) * max(w, 4) * tokens * heads


def replayed_bytes(c: ModelConfig, cfg: Layout) -> int:
    """--recompute-selective: what one layer's replay adds in its backward, one micro-batch: the plain
    layer's tensors less those it kept, and w_down's kept output, which the replay never claims (it stops
    at w_down's input, torch's early stop) and which stays in the cache until the layer's backward ends."""
    plain = replace(cfg, recompute_selective=False)
    w_down = of_config(cfg).activation_width * cfg.micro_batch * cfg.seq_len * c.dim  # whole: partial sums
    return layer_activation_bytes(c, plain) - layer_activation_bytes(c, cfg) + w_down


def weight_casts(c: ModelConfig, cfg: Layout) -> int:
    """Under bf16 autocast, the bf16 copy of each weight matrix of a layer that backward keeps:
    made once per autocast region, so once per layer however many micro-batches are in flight."""
    if of_config(cfg).autocast is None:  # bf16-mixed: the weights are bf16 already, no copies
        return 0
    t, d, kv = cfg.tp, c.dim, c.n_kv_heads * c.head_dim
    if cfg.tp_overlap and t > 1:  # a region's column layers cast inside one autograd node, keeping no copy
        return 2 * (d * d // t + (0 if cfg.recompute_mlp else d * c.ffn_dim // t))  # wo's and w_down's
    mlp = 0 if cfg.recompute_mlp else 3 * d * c.ffn_dim // t  # --recompute-mlp: made again in its replay, not kept
    return 2 * (2 * d * d // t + mlp + 2 * d * kv // (t if c.n_kv_heads % t == 0 else 1))


def head_activation_bytes(c: ModelConfig, cfg: Layout) -> int:
    """The final norm, the LM head's logits (kept by the loss in at least fp32) and the targets."""
    w, t, tokens = of_config(cfg).activation_width, cfg.tp, cfg.micro_batch * cfg.seq_len // cfg.cp
    sp, overlap = (t if cfg.sp else 1), cfg.tp_overlap and t > 1  # overlap: the head keeps its input as it arrives
    vocab = -(-c.vocab_size // t)
    logits = tokens * vocab * max(w, 4) + 8 * tokens  # kept by the loss in at least fp32; the targets
    if of_config(cfg).autocast is not None:  # x, x/rms in fp32; bf16 copies of the normed input and head weight
        kept = 4 * tokens * c.dim // sp if overlap else 2 * (tokens * c.dim + vocab * c.dim)
        return 4 * (2 * tokens * c.dim // sp + tokens // sp) + kept + logits
    return w * (tokens * c.dim // (sp if overlap else 1) + 2 * tokens * c.dim // sp + tokens // sp) + logits


def moe_layer_activation_bytes(c: ModelConfig, cfg: Layout, worst: bool = False) -> int:
    """A mixture-of-experts layer's activations for one micro-batch: a dense layer's without its
    MLP (and its normed input is the rank's own share under sp: experts are not entered through
    tp), plus the MoE block's own (estimate_moe.moe_block_bytes; worst: dropless routing's bound)."""
    if cfg.recompute:
        return layer_activation_bytes(c, cfg)  # its input only
    tokens, t = cfg.micro_batch * cfg.seq_len // cfg.cp, cfg.tp
    shared = cfg.sp and not cfg.tp_overlap  # --tp-overlap: the dense layer's formula keeps the shard already
    shared_input = of_config(cfg).activation_width * tokens * c.dim * (t - 1) // t if shared else 0
    block = 0 if cfg.recompute_mlp else moe_block_bytes(c, cfg, worst)  # --recompute-mlp: its input, in the norms
    return layer_activation_bytes(replace(c, ffn_dim=0), replace(cfg, recompute_mlp=False)) - shared_input + block


def activation_bytes(c: ModelConfig, cfg: Layout, pp_rank: int = 0, worst: bool = False) -> int:
    """The most activation bytes pp rank `pp_rank` holds during a step: its layers' activations times
    the micro-batches in flight, read off the pipeline schedule itself (1F1B keeps at most pp - rank,
    GPipe all of them), plus the head's on the last stage. Mixture-of-experts layers: dropless
    routing's expectation (worst: its bound), with a capacity factor, full expert buffers."""
    dense, head = layer_activation_bytes(c, cfg), head_activation_bytes(c, cfg)
    moe = moe_layer_activation_bytes(c, cfg, worst) if c.n_experts else 0
    rebuilt = 0  # with recompute, backward rebuilds one layer (--recompute-mlp: its MLP) at a time: the largest
    if cfg.recompute_selective:
        rebuilt = replayed_bytes(c, cfg)
    elif cfg.recompute or cfg.recompute_mlp:
        plain, kept = replace(cfg, recompute=False, recompute_mlp=False), int(cfg.recompute_mlp)
        rebuilt = max(layer_activation_bytes(c, plain) - kept * dense, (moe_layer_activation_bytes(c, plain, worst)
                      - kept * moe) if moe else 0) + (weight_casts(c, plain) - weight_casts(c, cfg)) * kept
    casts = weight_casts(c, cfg) * (1 if cfg.recompute else len(rank_model(c, cfg, pp_rank).layers))
    first_moe = c.dense_layers if c.n_experts else c.n_layers
    states = _alive(cfg.schedule, cfg.pp, cfg.accum_steps, cfg.virtual_stages, c.n_layers, first_moe, pp_rank,
                    cfg.stage_counts)
    return max(d * dense + e * moe + h * head for d, e, h in states) + rebuilt + casts


@lru_cache(maxsize=1024)
def _alive(schedule: str, pp: int, m: int, virtual: int, n_layers: int, first_moe: int, pp_rank: int,
           counts: tuple | None = None) -> frozenset:
    """Every (dense layers, MoE layers, heads) whose activations pp rank `pp_rank` holds at once
    during the schedule: a stage's live from its F until its B (or W, when the backward is split).
    Without a pipeline: one micro-batch's, the whole model."""
    if pp == 1:
        return frozenset({(min(first_moe, n_layers), n_layers - min(first_moe, n_layers), 1)})
    plan = cached_schedule(schedule, pp, m, virtual)
    actions = plan.actions[pp_rank]
    split, last = any(a.kind == "W" for a in actions), plan.n_stages - 1
    sizes = [(sum(i < first_moe for i in ls), sum(i >= first_moe for i in ls))
             for ls in stage_layers(n_layers, plan.n_stages, counts)]
    dense, moe, heads, states = 0, 0, 0, {(0, 0, 0)}
    for a in actions:
        sign = 1 if a.kind == "F" else -1 if a.kind == ("W" if split else "B") else 0
        dense, moe = dense + sign * sizes[a.stage][0], moe + sign * sizes[a.stage][1]
        heads += sign * (a.stage == last)
        states.add((dense, moe, heads))
    return frozenset(states)


cached_schedule = lru_cache(maxsize=64)(build_schedule)  # the planner asks for one schedule under many layouts


def peak_bytes(model_cfg: ModelConfig, cfg: Layout) -> int:
    """The most any rank holds: model states, activations at their peak and ZeRO's temporary
    buffers at theirs, added as if all three peaks fell at one moment (they need not: a bound)."""
    return max(sum(held_bytes(model_cfg, cfg, r).values()) + activation_bytes(model_cfg, cfg, r)
               + sum(temporary_bytes(model_cfg, cfg, r).values()) for r in range(cfg.pp))
