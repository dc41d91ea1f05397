"""Choosing a layout: every layout of the GPUs that fits in memory, ranked by a simple time model.

Chapter 8 (which states and tests each term): fit the memory (estimate.py, less `Cluster.headroom`),
keep tp inside a node, and take what the clock (`step_time`, arithmetic) says is fastest:

    compute   step_flops (6 per parameter and token, 8 with recompute) at `mfu` of the peak, and the
              bytes a selective replay rebuilds (replayed_bytes), moved at HBM's bandwidth
    traffic   each group's bytes over its link, plus a latency a message; dp hidden behind backward
    bubble    the schedule's idle fraction f from its own simulation, as f / (1 - f) of the rest

`check_memory` refuses a run that would not fit; `report` is `train.py --plan`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import islice, product

import torch

from minipar.comm_clock import exposed_line
from minipar.layout import Layout
from minipar.model import ModelConfig, get_config
from minipar.muon import MUON_METHODS
from minipar.pipeline.schedules import build as build_schedule
from minipar.pipeline.timeline import simulate
from minipar.planning.estimate import (
    activation_bytes,
    held_bytes,
    layer_activation_bytes,
    peak_bytes,
    rank_model,
    replayed_bytes,
    temporary_bytes,
    zero_buckets,
)
from minipar.planning.estimate_muon import muon_messages, ns_flops_per_rank
from minipar.planning.traffic import bytes_by_key, bytes_sent, calls_by_group, pipeline_messages, traffic
from minipar.precision import of_config

# (recompute, recompute_selective, recompute_mlp): backward redoes nothing, the cheap ops, the MLPs, whole layers
RECOMPUTE = ((False, False, False), (False, True, False), (False, False, True), (True, False, False))
PRECISION_NOTE = {"float64": "float64 throughout", "fp32": "fp32 throughout",
                  "bf16-autocast": "bf16-autocast (fp32 weights; backward keeps a bf16 copy of each layer's weights)",
                  "bf16-mixed": "bf16-mixed (bf16 weights and gradients, fp32 master and Adam state)"}
HEADROOM = 0.10  # of each GPU's memory kept free: CUDA context, NCCL's buffers, the allocator's fragmentation


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    memory: float = 80e9  # bytes per GPU
    flops: float = 989e12  # peak dense bf16 FLOP/s per GPU (H100 SXM)
    mfu: float = 0.45  # the share of peak the model's matmuls reach
    intra_bandwidth: float = 450e9  # bytes/s per GPU inside a node (NVLink, one direction)
    inter_bandwidth: float = 50e9  # bytes/s per GPU between nodes (400 Gb/s InfiniBand)
    memory_bandwidth: float = 3.35e12  # bytes/s per GPU (H100 SXM HBM3)
    headroom: float = HEADROOM
    # Measured (scripts/tools/plan.py --calibrate): each group size's (size, α seconds a message, β bytes/s)
    # stands for the bandwidths above and adds a latency to every message.
    links: tuple[tuple[int, float, float], ...] = ()

    @property
    def usable(self) -> float:
        """The bytes a rank's estimate may reach: the memory less the headroom."""
        return self.memory * (1 - self.headroom)


def layouts(model: str, cluster: Cluster, seq_len: int, global_batch: int, micro_batch: int = 1, optimizer="adamw"):
    """Every layout of the GPUs that passes minipar's checks (tp within a node; each Muon method under ZeRO)."""
    c = get_config(model)
    g = cluster.gpus
    for tp in (t for t in range(1, cluster.gpus_per_node + 1) if g % t == 0):  # the heads: validate's rule
        for pp in (p for p in range(1, c.n_layers + 1) if (g // tp) % p == 0):
            for cp in (x for x in ((1, 2, 4, 8) if seq_len >= 8192 else (1,)) if g // (tp * pp) % x == 0):
                for zero in (0, 1, 2, 3):
                    methods = MUON_METHODS if optimizer == "muon" and zero else ("gather",)
                    for (full, selective, mlp), method in product(RECOMPUTE, methods):
                        cfg = Layout(model=model, dp=g // (tp * pp * cp), tp=tp, pp=pp, cp=cp, sp=tp > 1, zero=zero,
                                     recompute=full, recompute_selective=selective, recompute_mlp=mlp, seq_len=seq_len,
                                     global_batch=global_batch, micro_batch=micro_batch, dtype="bfloat16",
                                     vocab_size=c.vocab_size, optimizer=optimizer, muon_method=method)
                        try:
                            cfg.validate(g)
                        except ValueError:
                            continue
                        yield cfg


def step_flops(c: ModelConfig, cfg: Layout) -> float:
    """FLOPs of one optimizer step: flops_per_token's 6 per parameter (2 forward, 4 backward) and token,
    plus attention. Full recompute runs every forward again: 8/6 of it. Recompute of the MLPs runs
    only each dense MLP's three matmuls again, 2·3·d·ffn per token and layer: 2/3 of a layer's matmuls
    where ffn = 8d/3 and kv heads = heads; at 70B (d 8,192, ffn 28,672, 8 kv heads of 64) 82% of them,
    and with attention's scores at s 8,192, 1.41 of a layer's 1.98 GFLOP forward a token (71%). Selective
    recompute redoes no matmul, but under ring attention (one node of its own) the scores' 4·d·s."""
    tokens, mlps = cfg.global_batch * cfg.seq_len, sum(c.feed_forward(i) == "mlp" for i in range(c.n_layers))
    flops = tokens * c.flops_per_token(cfg.seq_len)
    ring = cfg.recompute_selective and cfg.cp > 1 and cfg.cp_attention == "ring"
    flops += ring * tokens * c.n_layers * 4 * c.dim * cfg.seq_len
    return flops * 8 / 6 if cfg.recompute else flops + cfg.recompute_mlp * tokens * mlps * 6 * c.dim * c.ffn_dim


def step_time(c: ModelConfig, cfg: Layout, cluster: Cluster) -> dict[str, float]:
    """Seconds of one optimizer step under the clock of the module docstring, by part."""
    compute = step_flops(c, cfg) / (cluster.gpus * cluster.flops * cluster.mfu)
    compute += max(ns_flops_per_rank(c, cfg)) / (cluster.flops * cluster.mfu)  # Muon's, on its busiest rank
    if cfg.recompute_selective:  # element-wise ops: their time is the memory they move, not their FLOPs
        layers = -(-c.n_layers // cfg.pp)  # a rank's layers, each replayed once a micro-batch
        compute += 2 * replayed_bytes(c, cfg) * layers * cfg.accum_steps / cluster.memory_bandwidth
    step = traffic(c, cfg)  # pp rank 0's messages: equal to the ledger's on CPU
    sent, calls = bytes_by_key(step), calls_by_group(step)
    between = pipeline_messages(c, cfg, min(1, cfg.pp - 1))  # a middle stage's messages between stages: the most

    def over(prefix: str, span: int, size: int, sent=sent, calls=calls) -> float:
        latency, bandwidth = _link(cluster, span, size)
        return calls[prefix] * latency + sum(v for k, v in sent.items() if k.split("/")[0] == prefix) / bandwidth
    idle = pipeline_idle(cfg.schedule, cfg.pp, cfg.accum_steps, cfg.virtual_stages)  # of the whole step
    latency, bandwidth = _link(cluster, cfg.dp * cfg.tp * cfg.pp * cfg.cp, 2)  # one rank to the next
    turns = {"compute": compute, "tp": over("tp", cfg.tp, cfg.tp), "cp": over("cp", cfg.tp * cfg.cp, cfg.cp),
             "pp": (len(between) + (cfg.pp > 1)) * latency  # the stages' messages, the norm's
             + sum(n for _, n in between) / bandwidth}  # the micro-batches' turns
    group = "dp_cp" if cfg.cp > 1 else "dp"
    dp = over(group, cfg.tp * cfg.cp * cfg.dp, cfg.dp * cfg.cp)
    mine = Counter(muon_messages(m := rank_model(c, cfg), cfg, zero_buckets(m, cfg) if cfg.zero else []))  # pp rank 0's
    muon = over(group, cfg.tp * cfg.cp * cfg.dp, cfg.dp * cfg.cp, bytes_by_key(mine), calls_by_group(mine))
    # dp hides behind backward, but for plain dp's last bucket, whose all-reduce is posted once backward is
    # done (one of its messages but train_step's count of targets) and Muon's, in the optimizer's step
    last = (dp - muon) / max(1, calls[group] - 1) if cfg.zero == 0 else 0.0
    parts = {**turns, "dp": muon + max(last, dp - muon - 2 / 3 * compute),
             "bubble": idle / (1 - idle) * sum(turns.values())}  # idle f of the step is f / (1 - f) of the turns
    return {**parts, "total": sum(parts.values())}


def messages(c: ModelConfig, cfg: Layout, pp_rank: int = 0) -> Counter:
    """The messages pp rank `pp_rank` sends in a step by group, for the clock's latency (Cluster.links):
    the very messages whose bytes bytes_sent adds up (traffic.py), equal to the ledger's calls."""
    return calls_by_group(traffic(c, cfg, pp_rank))


@lru_cache(maxsize=256)  # many layouts share a schedule
def pipeline_idle(schedule: str, pp: int, m: int, virtual: int = 1) -> float:
    """The share of a step the pipeline's ranks wait: the schedule simulated with unit costs."""
    return simulate(build_schedule(schedule, pp, m, virtual)).idle_fraction() if pp > 1 else 0.0


def _link(cluster: Cluster, span: int, size: int) -> tuple[float, float]:
    """A message's latency and a group's bytes/s: measured for its size where Cluster.links has it, else
    no latency, and a group whose ranks lie within `span` consecutive ranks (mesh.py: tp varies fastest,
    then cp, dp, pp) stays inside a node's bandwidth when span <= gpus_per_node."""
    measured = {n: (alpha, beta) for n, alpha, beta in cluster.links}
    if size in measured:
        return measured[size]
    return 0.0, cluster.intra_bandwidth if span <= cluster.gpus_per_node else cluster.inter_bandwidth


@dataclass(frozen=True)  # weigh's answers are cached: shared, never changed
class Choice:
    cfg: Layout
    time: dict[str, float] | None  # None: not timed (it does not fit)
    memory: int  # bytes on the fullest rank

    def flags(self) -> str:
        return self.cfg.as_flags()


def plan(model: str, cluster: Cluster, seq_len: int, global_batch: int, micro_batch: int = 1, optimizers=("adamw",)):
    """(the layouts that fit under any of the optimizers, fastest first; how many did not fit)."""
    c = get_config(model)
    if c.n_experts:
        raise ValueError(f"--model {model}: the planner does not search expert-parallel layouts yet (ep "
                         f"and the all-to-all's time); choose a dense model, or ask train.py --plan about one layout")
    weighed = [ch for opt in optimizers for ch in weigh(model, cluster, seq_len, global_batch, micro_batch, opt)]
    fits = [ch for ch in weighed if ch.time is not None]
    return sorted(fits, key=lambda ch: (round(ch.time["total"], 6), ch.cfg.tp * ch.cfg.pp * ch.cfg.cp,
                                        ch.cfg.virtual_stages)), len(weighed) - len(fits)


@lru_cache(maxsize=8)  # a question asked again in one process (the figures and the tests ask 8b's twice)
def weigh(model: str, cluster: Cluster, seq_len: int, global_batch: int, micro_batch: int = 1,
          optimizer: str = "adamw") -> tuple[Choice, ...]:
    """Every layout the planner weighs, with its fullest rank's bytes, timed where they fit the usable
    memory: those of `layouts`, and each pipelined one that fits interleaved too."""
    c, weighed = get_config(model), []
    for cfg in layouts(model, cluster, seq_len, global_batch, micro_batch, optimizer):
        weighed.append(_weighed(c, cfg, cluster))
        if cfg.pp > 1 and weighed[-1].time is not None:
            weighed += interleaved_twins(c, weighed[-1], cluster)
    return tuple(weighed)


def _weighed(c: ModelConfig, cfg: Layout, cluster: Cluster) -> Choice:
    memory = peak_bytes(c, cfg)
    return Choice(cfg, step_time(c, cfg, cluster) if memory <= cluster.usable else None, memory)


def interleaved_twins(c: ModelConfig, choice: Choice, cluster: Cluster) -> Iterator[Choice]:
    """A pipelined layout with v = 2, 3, ... stages a rank (pp·v dividing the layers) while each is
    faster than the last and fits: time falls then rises with v, memory only grows, so stop at the first worse."""
    pp, best = choice.cfg.pp, choice.time["total"]
    for v in (v for v in range(2, c.n_layers // pp + 1) if c.n_layers % (pp * v) == 0):
        cfg = replace(choice.cfg, schedule="interleaved", virtual_stages=v)
        try:
            cfg.validate(cluster.gpus)
        except ValueError:  # the micro-batches not a multiple of pp: so for every v
            return
        time = step_time(c, cfg, cluster)
        if time["total"] >= best:
            return
        twin = Choice(cfg, time, peak_bytes(c, cfg))
        if twin.memory > cluster.usable:
            yield replace(twin, time=None)
            return
        yield twin
        best = time["total"]


# -- Will it fit? (train.py asks before building anything; --plan shows the figures) ---------------


def device_memory() -> tuple[int, str]:
    """(bytes one rank may use, what they are): the GPU's memory, or this machine's available
    memory shared by the ranks torchrun starts on it."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "GPU memory"
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return available // ranks, f"available memory / {ranks} local ranks"


def check_memory(cfg: Layout, limit: int | None = None, headroom: float = HEADROOM) -> None:
    """Raises ValueError (one line) when a rank would hold more than its memory less the headroom,
    naming up to three layouts of the same ranks that would fit."""
    model_cfg = cfg.model_config()
    limit, what = (limit, "the limit") if limit is not None else device_memory()
    need, usable = peak_bytes(model_cfg, cfg), limit * (1 - headroom)
    if need <= usable:
        return
    fits = list(islice((alt.as_flags(cfg) for alt in _alternatives(cfg, model_cfg)
                        if peak_bytes(model_cfg, alt) <= usable), 3))
    held = "weights, gradients, optimizer state, activations and ZeRO's buffers" if cfg.zero else \
        "weights, gradients, optimizer state and activations"
    kept = f" less {headroom:.0%} headroom ({usable / 2**30:.1f} GiB)" if headroom else ""
    raise ValueError(f"--model {cfg.model} needs {need / 2**30:.1f} GiB per rank for {held}, more than {what} "
                     f"({limit / 2**30:.1f} GiB){kept}: " + (f"with these ranks, {' or '.join(fits)} would fit" if fits
                                                              else "no layout of these ranks fits: use more ranks or a "
                                                              "smaller --model, --micro-batch or --seq-len"))


def _alternatives(cfg: Layout, model_cfg: ModelConfig):
    """Other layouts of the same ranks that pass every check, fewest model cuts first: tp x pp
    (dp takes the rest), then the ZeRO stage, then recompute (none, the MLPs', the whole layers')."""
    world = cfg.dp * cfg.tp * cfg.pp * cfg.cp
    cuts = [(tp, pp) for tp in range(1, world + 1) for pp in range(1, model_cfg.n_layers + 1)
            if world % (tp * pp * cfg.cp) == 0]
    for tp, pp in sorted(cuts, key=lambda c: (c[0] * c[1], c[1])):
        for zero in range(4):
            for full, selective, mlp in RECOMPUTE:
                dp = world // (tp * pp * cfg.cp)
                alt = replace(cfg, dp=dp, tp=tp, pp=pp, zero=zero, recompute=full, recompute_selective=selective,
                              recompute_mlp=mlp, sp=cfg.sp and tp > 1,
                              ep=cfg.ep if dp * cfg.cp % cfg.ep == 0 else 1, virtual_stages=1, schedule="1f1b")
                try:
                    alt.validate(world)
                except ValueError:
                    continue
                yield alt


def report(cfg: Layout) -> str:
    """`train.py --plan`: what each pipeline rank will hold under cfg, and whether it fits."""
    c = cfg.model_config()
    limit, what = device_memory()
    lines = [f"--model {cfg.model} ({c.num_params() / 1e6:,.1f}M parameters, vocabulary {c.vocab_size}), "
             f"dp {cfg.dp} tp {cfg.tp} pp {cfg.pp} cp {cfg.cp} ep {cfg.ep}, --zero {cfg.zero}, "
             f"{PRECISION_NOTE[of_config(cfg).name]}",
             f"{'pp rank':>8} {'weights':>12} {'gradients':>12} {'optimizer':>12} {'activations':>12} "
             f"{'ZeRO buffers':>12} {'total':>12}   (MiB per rank; activations and buffers at their peak in the step)"]
    for r in range(cfg.pp):
        held = [*held_bytes(c, cfg, r).values(), activation_bytes(c, cfg, r), sum(temporary_bytes(c, cfg, r).values())]
        lines.append(f"{r:>8} " + " ".join(f"{v / 2**20:>12,.1f}" for v in (*held, sum(held))))
    lines.append(f"the fullest rank needs {peak_bytes(c, cfg) / 2**30:.2f} GiB ({what}: {limit / 2**30:.1f} GiB, "
                 f"less {HEADROOM:.0%} headroom: {limit * (1 - HEADROOM) / 2**30:.1f} GiB)"
                 + (": expert layers' activations for dropless routing spread evenly over the experts"
                    if c.n_experts and not c.capacity_factor else ""))
    if cfg.recompute_selective:  # chapter 11: what a layer keeps and what its replay rebuilds
        plain = layer_activation_bytes(c, replace(cfg, recompute_selective=False))
        lines.append(f"--recompute-selective: a layer keeps {layer_activation_bytes(c, cfg) / 2**20:,.1f} MiB "
                     f"(without: {plain / 2**20:,.1f}); its replay rebuilds {replayed_bytes(c, cfg) / 2**20:,.1f} MiB "
                     "in backward, one layer at a time")
    if cfg.zero:
        lines.append("ZeRO's buffers of a moment in the step (pp rank 0), in the total: " + ", ".join(
            f"{k} {v / 2**20:,.1f} MiB" for k, v in temporary_bytes(c, cfg).items()))
    if cfg.zero == 3 and cfg.zeropp:  # ZeRO++ (planning/estimate_zeropp.py): hpZ's copy is what it adds to the weights
        copy = held_bytes(c, cfg)["params"] - held_bytes(c, replace(cfg, zeropp=None))["params"]
        lines.append(f"ZeRO++ {cfg.zeropp}: hpZ's node-local copy, in the weights: {copy / 2**20:,.1f} MiB; "
                     "dp_intra's bytes stay inside a node, dp_cross's cross")
    step = f"a step: {step_flops(c, cfg) / 1e12:,.1f} TFLOP in all"
    if cfg.pp > 1:
        idle = pipeline_idle(cfg.schedule, cfg.pp, cfg.accum_steps, cfg.virtual_stages)
        step += f"; the pipeline idles {idle:.1%} of the step (its schedule simulated: F = 1, B = 2, or 1 each " \
                "for F, B and W when B is split)"
    lines.append(step)
    if cfg.optimizer == "muon":  # estimate_muon.py: its state is in the optimizer column, its messages below
        lines.append(f"Muon (--muon-method {cfg.muon_method}): one momentum buffer per matrix (AdamW: two moments); "
                     f"Newton-Schulz {max(ns_flops_per_rank(c, cfg)) / 1e9:,.1f} GFLOP on the busiest dp rank")
    lines.append("bytes pp rank 0 sends per step: " + ", ".join(f"{k} {v / 2**20:,.1f} MiB"
                                                                for k, v in bytes_sent(c, cfg).items()))
    return "\n".join([*lines, predicted_exposed(c, cfg)])


def predicted_exposed(c: ModelConfig, cfg: Layout) -> str:
    """The clock's step on H100s in the training log's words: the communication it does not hide and,
    for pp, its messages and the bubble (a stage waits in a receive: the log counts it as pp's)."""
    gpus = cfg.dp * cfg.tp * cfg.pp * cfg.cp
    t = step_time(c, cfg, Cluster(gpus))
    kinds = {"dp": cfg.dp * cfg.cp, "tp": cfg.tp, "cp": cfg.cp, "pp": cfg.pp}
    exposed = {k: t[k] + (t["bubble"] if k == "pp" else 0) for k, degree in kinds.items() if degree > 1}
    return (f"predicted on {gpus} H100s (the planner's clock, MFU {Cluster.mfu:.0%}): "
            f"{exposed_line(exposed, t['total'])}" + (" (ep's all-to-all not predicted)" if cfg.ep > 1 else ""))
