"""What each rank sends in a step, message by message, worked out before anything runs (chapter 8).

The planner's clock pays each message a latency and its bytes over a bandwidth. Each module states
its own messages (tensor_parallel, context_parallel, schedules, estimate_moe, estimate_zeropp,
estimate_muon); `traffic` counts how often a rank sends each, as ("group/op", bytes) pairs, and
`bytes_sent` by key, which tests/test_estimate.py holds equal to the ledger's.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import torch

from minipar.collectives import ring_bytes_sent
from minipar.context_parallel import attention_messages
from minipar.data_parallel import bucket_params, by_grad_mean
from minipar.layout import Layout
from minipar.model import ModelConfig
from minipar.moe import MoE
from minipar.pipeline.schedules import messages_per_step
from minipar.placement import DENSE, placement_of
from minipar.planning.estimate import bucket_size, cached_schedule, grad_replicas, rank_model, zero_buckets
from minipar.planning.estimate_moe import moe_messages
from minipar.planning.estimate_muon import muon_messages
from minipar.planning.estimate_zeropp import bucket_messages
from minipar.precision import of_config, widths
from minipar.tensor_parallel import loss_messages, region_messages


def add(sent: Counter, messages, times: int = 1) -> Counter:
    """Count `messages`, ("group/op", bytes sent) pairs, `times` over into `sent`; those of no bytes (a
    group of one rank) are no message: `bytes_sent` and planner.messages skip them."""
    for message in messages:
        sent[message] += times
    return sent


def _ring(key: str, nbytes: int, n: int) -> tuple[str, int]:
    """A message of the ledger's "group/op" `key`: what one of `n` ranks sends of an `nbytes` payload."""
    return key, ring_bytes_sent(key.split("/")[1], nbytes, n)


def dp_traffic(model_cfg: ModelConfig, cfg: Layout, pp_rank: int = 0) -> Counter:
    """What pp rank `pp_rank` sends in a step over its dp groups (dp, dp x cp, edp): the count of targets,
    the gradients' all-reduce by bucket, or ZeRO's reduce-scatter (stage 2-3: each micro-batch) and
    all-gather (stage 3: forward and backward of each), and the norm's partial sums."""
    n, m = cfg.dp * cfg.cp, cfg.accum_steps
    if n == 1:
        return Counter()
    model = rank_model(model_cfg, cfg, pp_rank)
    _, width, wire = widths(cfg)  # weights are gathered at their width, gradients sent at the wire's
    sent = Counter([_ring(f"{_dp_name(DENSE, cfg)}/all_reduce", 8, n)])
    if cfg.zero == 0:  # a bucket never mixes reduction groups (DataParallel._make_buckets)
        for dims, params in by_grad_mean(list(reversed(list(model.parameters())))).items():
            add(sent, [_ring(f"{_dp_name(dims, cfg)}/all_reduce", sum(p.numel() for p in chunk) * wire,
                             grad_replicas(dims, cfg)) for chunk in bucket_params(params, cfg.bucket_mb)])
        return sent
    for _, dims, chunk in zero_buckets(model, cfg):
        r, group = grad_replicas(dims, cfg), _dp_name(dims, cfg)
        padded = bucket_size(model, cfg, dims, chunk)
        if cfg.zero == 3 and cfg.zeropp:  # ZeRO++ sends its own messages (planning/estimate_zeropp.py)
            add(sent, bucket_messages(padded, cfg, width, wire), m)
            continue
        sent[_ring(f"{group}/reduce_scatter", padded * wire, r)] += m if cfg.zero >= 2 else 1
        sent[_ring(f"{group}/all_gather", padded * width, r)] += 2 * m if cfg.zero == 3 else 1
    for group, (size, times) in _norm_sums(model, cfg).items():
        if group in ("dp", "dp_cp", "edp"):
            sent[_ring(f"{group}/all_reduce", _grad_width(cfg), size)] += times
    return sent


def _dp_name(grad_mean: tuple[str, ...], cfg: Layout) -> str:
    return "edp" if tuple(grad_mean) != DENSE else "dp" if cfg.cp == 1 else "dp_cp"


def _norm_sums(model, cfg: Layout) -> dict[str, tuple[int, int]]:
    """{group: (its size, how many all-reduces)}: clip_grads sums the squares of each kind of
    gradient (those whose other pieces lie on the same groups: tp, ep, ZeRO's) over those groups."""
    sizes = {"tp": cfg.tp, "ep": cfg.ep}
    kinds = set()
    for _, dims, chunk in zero_buckets(model, cfg) if cfg.zero else [((), (), [p]) for p in model.parameters()]:
        groups = [(d, sizes[d]) for d, _ in placement_of(chunk[0]).shards]
        groups += [(_dp_name(dims, cfg), grad_replicas(dims, cfg))] if cfg.zero else []
        kinds.add(tuple(g for g in groups if g[1] > 1))
    times = Counter(g for kind in kinds for g in kind)
    return {name: (size, k) for (name, size), k in times.items()}


def bytes_sent(model_cfg: ModelConfig, cfg: Layout, pp_rank: int = 0, dp_rank: int | None = None) -> dict[str, int]:
    """Everything pp rank `pp_rank` sends in one step, by the ledger's "group/op" keys (dp_rank: Muon's)."""
    return bytes_by_key(traffic(model_cfg, cfg, pp_rank, dp_rank))


def bytes_by_key(sent: Counter) -> dict[str, int]:
    """A step's messages (`add`'s count) as bytes by "group/op" key, as the ledger's "sent"."""
    out = Counter()
    for (key, nbytes), times in sent.items():
        out[key] += times * nbytes
    return {k: v for k, v in out.items() if v}


def calls_by_group(sent: Counter) -> Counter:
    """A step's messages (`add`'s count) by group, pipeline gradients' (pp_grad) with pp's: the ledger's
    calls on groups of two ranks or more (a message of no bytes is none)."""
    calls = Counter()
    for (key, nbytes), times in sent.items():
        calls[key.split("/")[0].removesuffix("_grad")] += times * (nbytes > 0)
    return calls


def traffic(model_cfg: ModelConfig, cfg: Layout, pp_rank: int = 0, dp_rank: int | None = None) -> Counter:
    """Every message pp rank `pp_rank` sends in a step, as `add` counts them: dp_traffic's, Muon's, tp's
    (`_tp_messages`), the pipeline's, cp's, the experts' (estimate_moe: exact with a capacity factor
    every expert fills, else uniform routing's expectation), each group's share of the norm."""
    sent = dp_traffic(model_cfg, cfg, pp_rank)
    model, m, w = rank_model(model_cfg, cfg, pp_rank), cfg.accum_steps, of_config(cfg).activation_width
    add(sent, muon_messages(model, cfg, zero_buckets(model, cfg) if cfg.zero else [], dp_rank))  # estimate_muon.py
    layers, moe_blocks = len(model.layers), sum(isinstance(x, MoE) for x in model.modules())
    norm = _grad_width(cfg)
    if moe_blocks:
        add(sent, moe_messages(model_cfg, cfg), m * moe_blocks)
        if "ep" in _norm_sums(model, cfg):  # the experts' squares, summed over the ep ranks holding the rest
            sent[_ring("ep/all_reduce", norm, cfg.ep)] += 1
    tokens = cfg.micro_batch * cfg.seq_len // cfg.cp  # this rank's, per micro-batch
    # Under bf16 autocast the matmuls' outputs (and their gradients) are bf16, but the residual
    # stream, the norms' outputs and RoPE's rotations stay in the weights' fp32 (bf16-mixed: bf16).
    weight_width = widths(cfg)[1]
    stream, product = tokens * model_cfg.dim * weight_width, tokens * model_cfg.dim * w
    if cfg.tp > 1:
        add(sent, _tp_messages(model, cfg, moe_blocks, tokens, stream, product), m)
        sent[_ring("tp/all_reduce", norm, cfg.tp)] += 1  # the norm of the tp shards
        partial = [p.numel() for p in model.parameters() if "tp" in placement_of(p).partial]
        if partial and cfg.zero == 0:  # sp's norm weights: summed over tp once per step (one message)
            sent[_ring("tp/all_reduce", sum(partial) * weight_width, cfg.tp)] += 1
        elif partial:  # ZeRO: per bucket that holds some, as it is reduced (stage 2-3: each micro-batch)
            for _, _, chunk in zero_buckets(model, cfg):
                numel = sum(p.numel() for p in chunk if "tp" in placement_of(p).partial)
                sent[_ring("tp/all_reduce", numel * weight_width, cfg.tp)] += m if cfg.zero >= 2 else 1
    if cfg.pp > 1:
        add(sent, pipeline_messages(model_cfg, cfg, pp_rank) + [_ring("pp/all_reduce", norm, cfg.pp)])
    if cfg.cp > 1:  # ring: K/V round the ring; ulysses: four all-to-alls (replayed under --recompute, -selective)
        heads, kv_heads = model_cfg.n_heads // cfg.tp, max(1, model_cfg.n_kv_heads // cfg.tp)
        add(sent, attention_messages(cfg.cp_attention, tokens, heads, kv_heads, model_cfg.head_dim, cfg.cp,
                                     weight_width, w, cfg.recompute or cfg.recompute_selective), m * layers)
    return sent


def _tp_messages(model, cfg: Layout, moe_blocks: int, tokens: int, stream: int, product: int) -> list[tuple[str, int]]:
    """tp's messages for one micro-batch: two a dense block's region, the embedding's and head's, the
    loss's; recompute replays each layer's (--recompute-mlp: MLP's) forward messages it needs."""
    t, layers, last = cfg.tp, len(model.layers), model.lm_head is not None
    blocks, gather = 2 * layers - moe_blocks, _ring("tp/all_gather", stream, t)
    ends = [gather, _ring("tp/reduce_scatter", stream, t)] if cfg.sp else [_ring("tp/all_reduce", stream, t)]
    sent = region_messages(stream, product, t, cfg.sp) * blocks + ends * ((model.tok_emb is not None) + last)
    whole = cfg.recompute or cfg.recompute_selective  # a layer replayed: -selective's sends what -recompute's does
    if whole or cfg.recompute_mlp:  # backward's replay stops once it has rebuilt what it needs
        # (torch's early stop): not a dense MLP's output (feeding a sum). --recompute: each attention's output (g)
        sent += [_ring("tp/reduce_scatter" if cfg.sp else "tp/all_reduce", product, t)] * (layers * whole)
        sent += [gather] * ((blocks if whole else layers - moe_blocks) * cfg.sp)  # -mlp: dense MLPs' input
    if cfg.tp_overlap and cfg.sp:  # each region (and the head) kept its input's shard: gathered again in backward
        sent += [gather] * (blocks + last)
    return sent + (loss_messages(tokens, of_config(cfg).activation_width, t) if last else [])


def _grad_width(cfg: Layout) -> int:
    """The width of the gradients the norm is taken of: the masters' (ZeRO's slices, bf16-mixed's), or the weights'."""
    prec = of_config(cfg)
    return torch.promote_types(prec.built, torch.float32).itemsize if cfg.zero or prec.mixed else prec.built.itemsize


def pipeline_messages(model_cfg: ModelConfig, cfg: Layout, pp_rank: int = 0) -> list[tuple[str, int]]:
    """What pp rank `pp_rank` sends between stages in a step (schedules.messages_per_step): a micro-batch's
    residual stream a message (sp: a tp rank's share of its tokens). No model is built: the planner's clock asks."""
    if cfg.pp == 1:
        return []
    stream = cfg.micro_batch * cfg.seq_len // cfg.cp * model_cfg.dim * widths(cfg)[1] // (cfg.tp if cfg.sp else 1)
    return [(key, stream) for key in _sends(cfg.schedule, cfg.pp, cfg.accum_steps, cfg.virtual_stages, pp_rank)]


@lru_cache(maxsize=1024)  # the planner weighs one schedule under many layouts: walk its actions once
def _sends(schedule: str, pp: int, m: int, virtual: int, pp_rank: int) -> tuple[str, ...]:
    return tuple(key for key, _ in messages_per_step(cached_schedule(schedule, pp, m, virtual), pp_rank, 0))
