"""Muon on paper (chapter 4c): the messages it adds and its Newton-Schulz FLOPs, per dp rank, as
muon.py's step does them (its one momentum buffer: estimate.held_bytes); tests/test_muon_plan.py."""

from __future__ import annotations

from types import SimpleNamespace

from minipar.collectives import ring_bytes_sent
from minipar.layout import Layout
from minipar.model import ModelConfig
from minipar.muon import cuts_a_parameter, muon_ids, ns_flops, owners, part, whole_shape
from minipar.placement import DENSE, placement_of
from minipar.planning.estimate import rank_model, zero_buckets
from minipar.zero import kept_whole, packed


def muon_work(model, cfg: Layout, plan, rank: int) -> tuple[list, list[tuple[str, int]]]:
    """(the Muon parameters dp rank `rank` orthogonalises, the messages it sends for them: (the ledger's
    "group/op" key, bytes sent)), as Muon.pieces does it. `plan`: estimate.zero_buckets's, under ZeRO."""
    ids, sizes, loads = muon_ids(model), {"tp": cfg.tp, "ep": cfg.ep}, {}
    mine, sent = [p for p in model.parameters() if id(p) in ids and not cfg.zero], []
    for _, dims, chunk in (b for b in plan if cfg.zero and id(b[2][0]) in ids):
        n = cfg.dp * cfg.cp // (1 if tuple(dims) == DENSE else cfg.ep)
        group, me = "edp" if tuple(dims) != DENSE else "dp" if cfg.cp == 1 else "dp_cp", rank % n
        layout = (kept_whole if cfg.muon_method == "whole" else packed)([p.numel() for p in chunk], n)
        b = SimpleNamespace(params=chunk, offsets=layout[0], padded=layout[1], group=SimpleNamespace(size=n))
        held = [len(part(b, i, me)) for i in range(len(chunk))]
        if cfg.muon_method == "owner" and cuts_a_parameter(b):
            load = loads.setdefault(group, [0] * n)  # as Muon.owner_pieces: balanced over the step's buckets
            owner = owners([ns_flops(whole_shape(q), cfg.muon_ns_steps) for q in chunk], n, load)
            mine += [q for q, o in zip(chunk, owner) if o == me]
            sent += [(f"{group}/all_to_all", 2 * sum(h for h, o in zip(held, owner) if o != me)),
                     (f"{group}/all_to_all", 2 * sum(q.numel() - h for q, h, o in zip(chunk, held, owner) if o == me))]
            continue
        if cfg.muon_method == "gather" and cuts_a_parameter(b):
            sent.append((f"{group}/all_gather", ring_bytes_sent("all_gather", 2 * b.padded, n)))
        mine += [q for q, h in zip(chunk, held) if h]
    for q in mine:  # tp's gathers, in bf16, before each Newton-Schulz
        for d in (d for d, k in placement_of(q).shards if k >= q.dim() - 2 and sizes[d] > 1):
            sent.append((f"{d}/all_gather", ring_bytes_sent("all_gather", 2 * q.numel() * sizes[d], sizes[d])))
    return mine, sent


def muon_messages(model, cfg: Layout, plan, dp_rank: int | None = None) -> list[tuple[str, int]]:
    """What Muon adds to a step's messages on dp rank `dp_rank` (None: the one that sends the most)."""
    ranks = [] if cfg.optimizer != "muon" else range(cfg.dp * cfg.cp) if dp_rank is None else [dp_rank]
    return max((muon_work(model, cfg, plan, r)[1] for r in ranks), key=lambda s: sum(b for _, b in s), default=[])


def ns_flops_per_rank(model_cfg: ModelConfig, cfg: Layout, pp_rank: int = 0) -> list[int]:
    """Newton-Schulz's FLOPs in a step on each dp rank of pp rank `pp_rank` (none without Muon)."""
    if cfg.optimizer != "muon":
        return [0]
    model, n = rank_model(model_cfg, cfg, pp_rank), cfg.dp * cfg.cp
    plan = zero_buckets(model, cfg) if cfg.zero else []
    return [sum(ns_flops(whole_shape(q), cfg.muon_ns_steps) for q in muon_work(model, cfg, plan, r)[0])
            for r in range(n if cfg.zero else 1)] * (1 if cfg.zero else n)
