"""Muon under data parallelism and ZeRO 1-3 equals Muon on one device (float64, 1e-12 relative, 8 steps:
every loss and every parameter), its extra messages are the formula's, and the tempting shortcut,
orthogonalising each rank's shard alone, is another optimizer: it fails the same comparison.

Why 1e-12 can hold though Newton-Schulz runs in bf16: see tests/test_muon.py's docstring. Each rank
orthogonalises the very matrix one device does (gathered whole), so the bf16 iteration sees the same
bits; only the float64 sums of gradients over ranks differ, by about 1e-16.
"""

from functools import cache, partial

import pytest
import torch
from harness import parallel_llama, run_ranks, run_ranks_once, tiers
from test_data_parallel import GLOBAL_BATCH, global_batch
from test_muon import CFG, FACTORS, MODELS, minipar_run, new_model, relative_error

from minipar.collectives import all_reduce
from minipar.mesh import Mesh
from minipar.muon import Muon
from minipar.parallelize import build_grad_sync, optimizer_of
from minipar.run.train import train_step
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


def _run(rank, world, model_name, zero, accum, tp=1, sp=False, shard_alone=False):
    """8 steps of Muon on `world` ranks, dp = world / tp: each rank's losses (the global batch's mean:
    averaged over dp), its ledger per step, the whole weights at the end."""
    with Mesh.build(dp=world // tp, tp=tp) as mesh:
        groups = mesh.groups()
        model = parallel_llama(MODELS[model_name], seed=1, tp_group=groups.tp, sequence_parallel=sp).double()
        param_groups, make = optimizer_of(model, CFG, groups)
        if shard_alone:
            make = partial(ShardAlone, **make.keywords)
        wrapper = build_grad_sync(model, groups, param_groups, make, zero=zero, bucket_mb=BUCKET_MB)
        dp, per = groups.dp.size, GLOBAL_BATCH // groups.dp.size
        rows = slice(groups.dp.rank * per, (groups.dp.rank + 1) * per)
        losses, ledgers = [], []
        for step, f in enumerate(FACTORS):
            for g in wrapper.optimizer.param_groups:  # as train_loop sets them
                g["lr"] = CFG.lr * f * g.get("lr_scale", 1.0)
            x, y = global_batch(step)
            mesh.ledger.reset()
            loss, _ = train_step(wrapper, list(zip(x[rows].chunk(accum), y[rows].chunk(accum))), grad_clip=1.0)
            losses.append(loss)
            ledgers.append(mesh.ledger.snapshot())
        mean = torch.tensor(losses, dtype=torch.float64)
        all_reduce(mean, groups.dp)
        with wrapper.gathered():
            params = {n: unshard(p.detach(), p, groups).clone() for n, p in model.named_parameters()}
        muon_masters = {id(p) for g in wrapper.optimizer.param_groups if g.get("muon") for p in g["params"]}
        buckets = [(b.padded, id(b.master) in muon_masters) for b in getattr(wrapper, "buckets", [])
                   if hasattr(b, "padded")]
        return dict(losses=(mean / dp).tolist(), params=params, ledgers=ledgers, buckets=buckets,
                    cut=matrices_cut(wrapper, muon_masters))


def matrices_cut(wrapper, muon_masters) -> int:
    """How many of Muon's parameters a ZeRO slice boundary falls inside (the case gathering is for)."""
    cut = 0
    for b in (b for b in getattr(wrapper, "buckets", []) if id(getattr(b, "master", None)) in muon_masters):
        bounds, start = [k * b.padded // b.group.size for k in range(1, b.group.size)], 0
        for q in b.params:
            cut += any(start < x < start + q.numel() for x in bounds)
            start += q.numel()
    return cut


@cache
def one_device(model_name):
    return minipar_run(model_name, CFG)


def assert_equals_one_device(result, model_name):
    losses, params = one_device(model_name)
    worst = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], losses, strict=True))
    assert worst <= 1e-12, (result["losses"], losses)
    for name, p in params.items():
        assert relative_error(result["params"][name], p) <= 1e-12, name


# (world, model, zero, accum)
LAYOUTS = [(2, "tiny", 0, 1), (4, "tiny", 0, 2), (2, "tiny", 1, 1), (4, "tiny", 1, 1), (2, "tiny", 2, 2),
           (4, "tiny", 2, 1), (2, "tiny", 3, 1), (4, "tiny", 3, 2), (2, "tiny-moe-no-aux", 1, 1)]


@pytest.mark.parametrize("world,model_name,zero,accum", tiers(LAYOUTS, fast=[0, 2]),
                         ids=[f"dp{w}-{m}-zero{z}-accum{a}" for w, m, z, a in LAYOUTS])
def test_muon_under_data_parallel_and_zero_equals_one_device_in_float64(world, model_name, zero, accum):
    for r in run_ranks_once(world, _run, model_name, zero, accum):
        assert_equals_one_device(r, model_name)
        assert (r["cut"] > 0) == (zero > 0)  # ZeRO's slices cut through some matrices: the gather is needed


@pytest.mark.parametrize("world,zero", tiers([(2, 0), (2, 1), (4, 2)], fast=1))
def test_muon_sends_one_bf16_all_gather_of_its_buckets_beyond_what_adamw_sends(world, zero):
    """Plain dp: the one all-reduce of gradients, no more (every rank holds whole matrices). ZeRO 1-2:
    beside the reduce-scatter of gradients and the all-gather of weights (8 bytes a number in float64),
    one all-gather of each Muon bucket's update in bf16: 2 bytes a number, (N-1)/N of them sent."""
    accum = 2 if (world, zero) == (4, 2) else 1
    for r in run_ranks_once(world, _run, "tiny", zero, accum):
        for ledger in r["ledgers"]:
            if zero == 0:
                assert "dp/all_gather" not in ledger
                continue
            weights = sum(padded * 8 for padded, _ in r["buckets"])
            muon = sum(padded * 2 for padded, is_muon in r["buckets"] if is_muon)
            assert muon > 0 and ledger["dp/all_gather"]["bytes"] == weights + muon
            assert ledger["dp/all_gather"]["sent"] == (weights + muon) * (world - 1) // world


@pytest.mark.parametrize("zero", tiers([1, 3], fast=0))
def test_orthogonalising_each_zero_slice_alone_fails_the_one_device_comparison(zero):
    losses, params = one_device("tiny")
    r = run_ranks(2, _run, "tiny", zero, 1, shard_alone=True)[0]
    assert max(relative_error(r["params"][n], p) for n, p in params.items()) > 1e-3
    with pytest.raises(AssertionError):
        assert_equals_one_device(r, "tiny")


# (world, tp, sp, zero): tp alone, with sequence parallelism, with dp, with ZeRO-1 over the dp ranks; tp 4
# is more than tiny's 2 kv heads: wk and wv are whole on every tp rank (their gradients summed over tp)
TP_LAYOUTS = [(2, 2, False, 0), (2, 2, True, 0), (4, 2, False, 0), (4, 2, True, 1), (4, 4, True, 0)]


@pytest.mark.parametrize("world,tp,sp,zero", tiers(TP_LAYOUTS, fast=0),
                         ids=[f"tp{t}-dp{w // t}" + ("-sp" if s else "") + f"-zero{z}" for w, t, s, z in TP_LAYOUTS])
def test_muon_under_tensor_parallel_equals_one_device_in_float64(world, tp, sp, zero):
    for r in run_ranks_once(world, _run, "tiny", zero, 1, tp=tp, sp=sp):
        assert_equals_one_device(r, "tiny")


def test_tp_gathers_each_muon_matrix_once_a_step_in_bf16():
    """wq, wk, wv, w_gate, w_up are cut by rows, wo and w_down by columns: each is all-gathered over tp
    (2 bytes a number, the whole matrix's payload) before Newton-Schulz, once a step. Without sp, tp
    sends nothing else by all-gather (its f and g are all-reduces)."""
    model = new_model("tiny")
    whole = sum(p.numel() * 2 for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2)
    for r in run_ranks_once(2, _run, "tiny", 0, 1, tp=2, sp=False):
        for ledger in r["ledgers"]:
            assert ledger["tp/all_gather"]["calls"] == 7 * MODELS["tiny"].n_layers
            assert ledger["tp/all_gather"]["bytes"] == whole and ledger["tp/all_gather"]["sent"] == whole // 2


def test_orthogonalising_each_tp_shard_alone_fails_the_one_device_comparison():
    losses, params = one_device("tiny")
    r = run_ranks(2, _run, "tiny", 0, 1, tp=2, shard_alone=True)[0]
    assert max(relative_error(r["params"][n], p) for n, p in params.items()) > 1e-3
    with pytest.raises(AssertionError):
        assert_equals_one_device(r, "tiny")
