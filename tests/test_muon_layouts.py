"""Muon in every layout equals Muon on one device (float64, 1e-12 relative, 8 steps: every loss and
every parameter): dp, ZeRO 1-3 (gather everywhere), tp (with sp, with dp, with ZeRO), pp under each
schedule, cp, ep with tp, and all of dp, tp and pp. Its extra messages are the formula's, and the
tempting shortcut, orthogonalising each rank's shard alone, is another optimizer: it fails the same
comparison.

Why 1e-12 can hold though Newton-Schulz runs in bf16: see tests/test_muon.py's docstring. Each rank
orthogonalises the very matrix one device does (gathered whole), so the bf16 iteration sees the same
bits; only the float64 sums of gradients over ranks differ, by about 1e-16.
"""

import math
from functools import cache, partial

import pytest
import torch
from harness import run_ranks, run_ranks_once, tiers
from test_data_parallel import GLOBAL_BATCH, SEQ, global_batch
from test_muon import CFG, FACTORS, MODELS, minipar_run, new_model, relative_error

import minipar.run.train as train
from minipar.context_parallel import split_sequence
from minipar.mesh import Mesh
from minipar.muon import Muon, cuts_a_parameter, ns_flops, owners
from minipar.parallelize import build_grad_sync, optimizer_of
from minipar.run.config import TrainConfig
from minipar.tensor_parallel import unshard

BUCKET_MB = 0.02  # about 2,600 float64 numbers a bucket: slices cut through matrices


class ShardAlone(Muon):
    """The shortcut: each rank orthogonalises only what it holds of a matrix (ZeRO: the other ranks'
    part of the bucket left at zero; tp: its shard alone), no gather."""

    def gather_slices(self, update, group):
        flat = update.new_zeros(update.numel() * group.size, dtype=torch.bfloat16)
        flat[group.rank * update.numel() : (group.rank + 1) * update.numel()] = update.bfloat16()
        return flat

    def cuts(self, q):
        return []


def _run(rank, world, model_name, layout, accum=1, shard_alone=False):
    """8 steps of Muon under `layout` (TrainConfig's settings), built as train.py builds it: this
    rank's losses (None off the last pp stage), its ledger per step, its whole weights at the end."""
    dp = layout.get("dp", 1)
    cfg = TrainConfig(**{**vars(CFG), "seq_len": SEQ, "global_batch": GLOBAL_BATCH, "seed": 1, "dtype": "float64",
                         "micro_batch": GLOBAL_BATCH // dp // accum, "bucket_mb": BUCKET_MB, **layout})
    with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
        if cfg.ep > 1:
            mesh.unflatten(("dp", "cp"), edp=cfg.dp * cfg.cp // cfg.ep, ep=cfg.ep)
        groups = mesh.groups()
        model, pipeline = train.build_model(cfg, mesh, MODELS[model_name], torch.device("cpu"), torch.float64)
        param_groups, make = optimizer_of(model, cfg, groups)
        if shard_alone:
            make = partial(ShardAlone, **make.keywords)
        wrapper = build_grad_sync(model, groups, param_groups, make, zero=cfg.zero, bucket_mb=BUCKET_MB)
        per, coord = GLOBAL_BATCH // cfg.dp, mesh.coord("dp")
        losses, ledgers = [], []
        for step, f in enumerate(FACTORS):
            for g in wrapper.optimizer.param_groups:  # as train_loop sets them: lr_at(step) x lr_scale
                g["lr"] = cfg.lr * f * g.get("lr_scale", 1.0)
            x, y = (split_sequence(t[coord * per : (coord + 1) * per], groups.cp) for t in global_batch(step))
            mesh.ledger.reset()
            micro = list(zip(x.split(cfg.micro_batch), y.split(cfg.micro_batch)))
            losses.append(train.train_step(wrapper, micro, cfg.grad_clip, pipeline=pipeline)[0])
            ledgers.append(mesh.ledger.snapshot())
        with wrapper.gathered():
            params = {n: unshard(p.detach(), p, groups).clone() for n, p in model.named_parameters()}
        muon_masters = {id(p) for g in wrapper.optimizer.param_groups if g.get("muon") for p in g["params"]}
        buckets = [(b.padded, id(b.master) in muon_masters and cuts_a_parameter(b))
                   for b in getattr(wrapper, "buckets", []) if hasattr(b, "padded")]  # ZeRO's: (size, gathers)
        cutting = [(b.padded, b.offsets, [tuple(q.shape) for q in b.params]) for b in getattr(wrapper, "buckets", [])
                   if id(getattr(b, "master", None)) in muon_masters and cuts_a_parameter(b)]  # Muon's, cut
        holds_loss = pipeline is None or pipeline.holds_last()
        return dict(losses=losses if holds_loss else None, params=params, ledgers=ledgers, buckets=buckets,
                    muon_buckets=cutting, rank=mesh.coord("dp"),
                    cut=matrices_cut(wrapper, muon_masters))


def matrices_cut(wrapper, muon_masters) -> int:
    """How many of Muon's parameters a ZeRO slice boundary falls inside (the case gathering is for)."""
    cut = 0
    for b in (b for b in getattr(wrapper, "buckets", []) if id(getattr(b, "master", None)) in muon_masters):
        bounds = [k * b.padded // b.group.size for k in range(1, b.group.size)]
        cut += sum(any(start < x < start + q.numel() for x in bounds) for q, start in zip(b.params, b.offsets))
    return cut


@cache
def one_device(model_name):
    return minipar_run(model_name, CFG)


def assert_equals_one_device(results, model_name):
    """Every rank's results together (pp: each stage its own parameters) against one device. Each rank's
    loss is its share of the global batch's mean, so their mean is the mean (test_loss_parity.py)."""
    losses, params = one_device(model_name)
    shares = [r["losses"] for r in results if r["losses"] is not None]
    ours = [sum(s[i] for s in shares) / len(shares) for i in range(len(FACTORS))]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, losses, strict=True))
    assert worst <= 1e-12, (ours, losses)
    held = {n: p for r in results for n, p in r["params"].items()}
    assert held.keys() == params.keys()
    for name, p in params.items():
        assert relative_error(held[name], p) <= 1e-12, name


# (world, model, layout, micro-batches a rank): "tiny4" is tiny with 4 layers, for 2 pp ranks' chunks
LAYOUTS = [
    (2, "tiny", dict(dp=2), 1), (4, "tiny", dict(dp=4), 2),
    (2, "tiny", dict(dp=2, zero=1), 1), (4, "tiny", dict(dp=4, zero=1), 1),
    (2, "tiny", dict(dp=2, zero=2), 2), (4, "tiny", dict(dp=4, zero=2), 1),
    (2, "tiny", dict(dp=2, zero=3), 1), (4, "tiny", dict(dp=4, zero=3), 2),
    (2, "tiny-moe-no-aux", dict(dp=2, zero=1), 1),
    # ZeRO's slices ending only between matrices (--muon-method whole): nothing to gather
    (2, "tiny", dict(dp=2, zero=1, muon_method="whole"), 1), (4, "tiny", dict(dp=4, zero=2, muon_method="whole"), 2),
    (4, "tiny", dict(dp=4, zero=3, muon_method="whole"), 1),
    (2, "tiny-moe-no-aux", dict(dp=2, zero=3, muon_method="whole"), 1),
    # tp: alone, with sp, with dp, with ZeRO-1 over dp; tp 4 is more than tiny's 2 kv heads: wk and wv
    # are whole on every tp rank (their gradients summed over tp)
    (2, "tiny", dict(tp=2), 1), (2, "tiny", dict(tp=2, sp=True), 1), (4, "tiny", dict(dp=2, tp=2), 1),
    (4, "tiny", dict(dp=2, tp=2, sp=True, zero=1), 1), (4, "tiny", dict(tp=4, sp=True), 1),
    # pp under each schedule, cp, experts over ep with tp, and three dimensions at once
    *[(2, "tiny4", dict(pp=2, schedule=s, **({"virtual_stages": 2} if s == "interleaved" else {})), 1 + (s != "naive"))
      for s in ("naive", "gpipe", "1f1b", "interleaved", "zb1", "zbv")],
    (2, "tiny", dict(cp=2), 1), (4, "tiny-moe-no-aux", dict(dp=2, tp=2, ep=2), 1),
    (8, "tiny4", dict(dp=2, tp=2, pp=2, zero=1), 2),
    # one owner per matrix (--muon-method owner): ZeRO 1-3, experts, and tp inside the owner's gather
    (2, "tiny", dict(dp=2, zero=1, muon_method="owner"), 1), (4, "tiny", dict(dp=4, zero=2, muon_method="owner"), 2),
    (4, "tiny", dict(dp=4, zero=3, muon_method="owner"), 1),
    (2, "tiny-moe-no-aux", dict(dp=2, zero=3, muon_method="owner"), 1),
    (4, "tiny", dict(dp=2, tp=2, sp=True, zero=1, muon_method="owner"), 1),
]
IDS = [f"{m}-" + "-".join(f"{k}{v}" for k, v in layout.items()) + f"-micro{a}" for _, m, layout, a in LAYOUTS]


@pytest.mark.parametrize("world,model_name,layout,accum", tiers(LAYOUTS, fast=[0, 2, 6, 10, 14, 20, 24, 25, 27]),
                         ids=IDS)
def test_muon_equals_one_device_in_float64_under_every_layout(world, model_name, layout, accum):
    results = run_ranks_once(world, _run, model_name, layout, accum, timeout=300)
    assert_equals_one_device(results, model_name)
    # ZeRO's slices cut through matrices (the case gathering is for), unless they end between them
    assert (results[0]["cut"] > 0) == (layout.get("zero", 0) > 0 and layout.get("muon_method") != "whole")


# (world, zero, method, micro-batches a rank): the runs of LAYOUTS above, read again
LEDGERS = [(2, 0, "gather", 1), (2, 1, "gather", 1), (4, 2, "gather", 1), (4, 2, "whole", 2), (4, 3, "whole", 1),
           (2, 1, "owner", 1), (4, 2, "owner", 2), (4, 3, "owner", 1)]


@pytest.mark.parametrize("world,zero,method,accum", tiers(LEDGERS, fast=[1, 3]))
def test_muon_sends_one_bf16_all_gather_of_its_buckets_beyond_what_adamw_sends(world, zero, method, accum):
    """Plain dp: the one all-reduce of gradients, no more (every rank holds whole matrices). ZeRO 1-2:
    beside the reduce-scatter of gradients and the all-gather of weights (8 bytes a number in float64),
    one all-gather in bf16 of the update of each Muon bucket whose slices cut a matrix: 2 bytes a number,
    (N-1)/N of them sent. With --muon-method whole, none: ZeRO pads instead, to end slices between matrices.
    With owner, none either: all-to-alls instead (test_owner_method_sends_each_matrix_to_its_owner_and_back)."""
    layout = {"dp": world, **({"zero": zero} if zero else {})}  # as LAYOUTS writes them: one run for both tests
    layout.update({"muon_method": method} if method != "gather" else {})
    for r in run_ranks_once(world, _run, "tiny", layout, accum, timeout=300):
        for ledger in r["ledgers"]:
            if zero == 0:
                assert "dp/all_gather" not in ledger
                continue
            weights = sum(padded * 8 for padded, _ in r["buckets"]) * (1 if zero < 3 else 2)  # ZeRO-3: fwd, bwd
            muon = sum(padded * 2 for padded, gathers in r["buckets"] if gathers)
            muon *= method == "gather"
            assert (muon > 0) == (method == "gather") and ledger["dp/all_gather"]["bytes"] == weights + muon
            assert ledger["dp/all_gather"]["sent"] == (weights + muon) * (world - 1) // world


def owner_bytes(padded: int, offsets: list[int], shapes: list[tuple], n: int, rank: int, load: list[int]) -> int:
    """The bytes `rank` sends for one cut Muon bucket under --muon-method owner: to each matrix's owner,
    the part its slice holds (unless it owns it); as owner, each rank the part of its slice (bf16: 2 bytes).
    `load`: the FLOPs the step's earlier buckets gave each rank (owners balance them over the step)."""
    per, owner = padded // n, owners([ns_flops(s, 5) for s in shapes], n, load)
    def held(i, r):  # numbers of matrix i in rank r's slice
        size = math.prod(shapes[i])
        return max(0, min(offsets[i] + size, (r + 1) * per) - max(offsets[i], r * per))
    there = sum(held(i, rank) for i in range(len(shapes)) if owner[i] != rank)
    back = sum(math.prod(shapes[i]) - held(i, rank) for i in range(len(shapes)) if owner[i] == rank)
    return 2 * (there + back)


@pytest.mark.parametrize("world,zero,accum,model_name", tiers([(2, 1, 1, "tiny"), (4, 2, 2, "tiny"), (4, 3, 1, "tiny"),
                                                               (2, 3, 1, "tiny-moe-no-aux")], fast=[1]))
def test_owner_method_sends_each_matrix_to_its_owner_and_back(world, zero, accum, model_name):
    """--muon-method owner: per cut Muon bucket, two all-to-alls a step (there and back) whose bytes are
    `owner_bytes`; the owners' Newton-Schulz FLOPs are balanced (no rank above the mean plus the largest)."""
    layout = dict(dp=world, zero=zero, muon_method="owner")
    for r in run_ranks_once(world, _run, model_name, layout, accum, timeout=300):
        load = [0] * world
        want = sum(owner_bytes(*b, world, r["rank"], load) for b in r["muon_buckets"])
        assert want > 0
        for ledger in r["ledgers"]:
            assert ledger["dp/all_to_all"]["calls"] == 2 * len(r["muon_buckets"])
            assert ledger["dp/all_to_all"]["sent"] == want
    flops = [ns_flops(s, 5) for _, _, shapes in r["muon_buckets"] for s in shapes]
    assert sum(load) == sum(flops) and max(load) <= sum(flops) / world + max(flops)


def test_tp_gathers_each_muon_matrix_once_a_step_in_bf16():
    """wq, wk, wv, w_gate, w_up are cut by rows, wo and w_down by columns: each is all-gathered over tp
    (2 bytes a number, the whole matrix's payload) before Newton-Schulz, once a step. Without sp, tp
    sends nothing else by all-gather (its f and g are all-reduces)."""
    model = new_model("tiny")
    whole = sum(p.numel() * 2 for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    for r in run_ranks_once(2, _run, "tiny", dict(tp=2), 1, timeout=300):
        for ledger in r["ledgers"]:
            assert ledger["tp/all_gather"]["calls"] == 7 * MODELS["tiny"].n_layers
            assert ledger["tp/all_gather"]["bytes"] == whole and ledger["tp/all_gather"]["sent"] == whole // 2


@pytest.mark.parametrize("layout", tiers([dict(dp=2, zero=1), dict(dp=2, zero=3), dict(tp=2)], fast=[0, 2]),
                         ids=["zero1", "zero3", "tp2"])
def test_orthogonalising_each_shard_alone_fails_the_one_device_comparison(layout):
    results = run_ranks(2, _run, "tiny", layout, 1, shard_alone=True)
    _, params = one_device("tiny")
    assert max(relative_error(results[0]["params"][n], p) for n, p in params.items()) > 1e-3
    with pytest.raises(AssertionError):
        assert_equals_one_device(results, "tiny")
