"""NCCL's ordering rules hold for every schedule, the context-parallel ring and ZeRO-3's prefetch.

Each case runs one training step on gloo ranks with the ledger's trace on, and order_check finds
no send without its receive in the same order and size, and no rank out of step in a collective.
"""

import pytest
import torch
from harness import parallel_llama, run_ranks, tiers

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import get_config
from minipar.order_check import order_problems
from minipar.parallelize import adamw, build_grad_sync
from minipar.pipeline.executor import Pipeline
from minipar.run.config import TrainConfig
from minipar.run.train import train_step

CFG = get_config("tiny", n_layers=8, vocab_size=250)
OPT = TrainConfig(lr=1e-2)
B, S = 8, 16


# ----------------------------------------------------------------------------------------------
# The checker itself, on hand-made traces
# ----------------------------------------------------------------------------------------------

PP = ("pp", (0, 1))


def test_matching_sends_receives_and_collectives_pass():
    traces = [[(PP, "send", 1, 64), (PP, "send", 1, 32), (PP, "all_reduce", None, 8)],
              [(PP, "recv", 0, 64), (PP, "all_reduce", None, 8), (PP, "recv", 0, 32)]]
    assert order_problems(traces) == []


def test_receives_posted_in_another_order_are_found():
    traces = [[(PP, "send", 1, 64), (PP, "send", 1, 32)], [(PP, "recv", 0, 32), (PP, "recv", 0, 64)]]
    assert order_problems(traces) == ["pp: rank 0 sends [64, 32] bytes to rank 1, which receives [32, 64] from it"]


def test_collectives_out_of_step_or_missing_are_found():
    swapped = [[(PP, "all_reduce", None, 8), (PP, "all_gather", None, 16)],
               [(PP, "all_gather", None, 16), (PP, "all_reduce", None, 8)]]
    assert order_problems(swapped) == ["pp[0, 1]: rank 1's collective #0 is all_gather of 16 bytes, rank 0's is "
                                       "all_reduce of 8 bytes"]
    assert order_problems([[(PP, "broadcast", None, 4)], []]) == [
        "pp[0, 1]: rank 1's collective #0 is missing, rank 0's is broadcast of 4 bytes"]


def test_all_to_alls_of_uneven_sizes_pass_but_one_out_of_place_is_found():
    EP = ("ep", (0, 1))  # expert parallelism: each rank sends as many tokens as its router chose
    uneven = [[(EP, "all_to_all", None, 16), (EP, "all_to_all", None, 512)],
              [(EP, "all_to_all", None, 16), (EP, "all_to_all", None, 384)]]
    assert order_problems(uneven) == []
    swapped = [[(EP, "all_to_all", None, 16), (EP, "all_reduce", None, 8)],
               [(EP, "all_reduce", None, 8), (EP, "all_to_all", None, 16)]]
    assert order_problems(swapped) == ["ep[0, 1]: rank 1's collective #0 is all_reduce of 8 bytes, rank 0's is "
                                       "all_to_all"]


# ----------------------------------------------------------------------------------------------
# Real runs
# ----------------------------------------------------------------------------------------------


def _batch(rows):
    x = torch.randint(0, 250, (B, S), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, dims=1)
    return x[rows], y[rows]


def _traced_step(rank, world, degrees, schedule=None, m=4, v=1, sp=False, zero3=False):
    """One training step of `degrees` (dp, tp, pp, cp) with the trace on; returns this rank's trace."""
    from minipar.context_parallel import split_sequence

    with Mesh.build(**degrees) as mesh:
        pipeline = (Pipeline(mesh.groups().pp, schedule, CFG.n_layers, v, grad_group=mesh.group("pp", channel="grad"),
                             seq_shards=mesh.layout.tp if sp else 1) if mesh.layout.pp > 1 else None)
        model = parallel_llama(CFG, seed=3, tp_group=mesh.groups().tp, sequence_parallel=sp, cp_group=mesh.groups().cp,
                      layer_ids=pipeline.my_layers() if pipeline else None,
                      embed=pipeline.holds_first() if pipeline else True,
                      head=pipeline.holds_last() if pipeline else True).double()
        wrapped = build_grad_sync(model, mesh.groups(), param_groups(model, OPT), lambda pgs: adamw(pgs, OPT.lr),
                                  zero=3 if zero3 else 0, bucket_mb=0.01)
        per = B // mesh.layout.dp
        x, y = _batch(slice(mesh.coord("dp") * per, (mesh.coord("dp") + 1) * per))
        x, y = split_sequence(x, mesh.groups().cp), split_sequence(y, mesh.groups().cp)
        mesh.ledger.trace = []
        train_step(wrapped, list(zip(x.chunk(m), y.chunk(m))), 1.0, pipeline=pipeline)
        return mesh.ledger.trace


SCHEDULES = [("naive", 1, 1), ("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 4, 2),
             ("zb1", 4, 1), ("zbv", 4, 1)]
PIPELINES = [dict(pp=2), dict(pp=4), dict(dp=2, pp=2), dict(tp=2, pp=2), dict(cp=2, pp=2)]


def _check(world, *args, **kwargs):
    traces = run_ranks(world, _traced_step, *args, timeout=300, **kwargs)
    problems = order_problems(traces)
    assert problems == [], "\n".join(problems)
    return traces


@pytest.mark.parametrize("degrees", tiers(PIPELINES, fast=1), ids=lambda d: "x".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("schedule,m,v", SCHEDULES, ids=[f"{s}-m{m}-v{v}" for s, m, v in SCHEDULES])
def test_every_schedule_posts_receives_in_the_order_of_the_sends(degrees, schedule, m, v):
    world = 1
    for d in degrees.values():
        world *= d
    if degrees.get("cp") and m > 2:  # each cp rank holds S/cp tokens of B/dp rows: keep micro-batches whole
        m = 2
    traces = _check(world, degrees, schedule, m, v, sp="tp" in degrees)
    p2p = sum(op in ("send", "recv") for trace in traces for _, op, _, _ in trace)
    assert p2p >= 2 * 2 * m  # the activations and gradients really crossed between stages (send + recv)


@pytest.mark.parametrize("cp", tiers([2, 4], fast=1))
def test_context_parallel_ring_keeps_nccl_order(cp):
    traces = _check(cp, dict(cp=cp), m=1)
    assert sum(op == "send" for _, op, _, _ in traces[0]) >= 2 * (cp - 1)  # forward and backward hops


@pytest.mark.parametrize("dp", tiers([2, 4], fast=0))
def test_zero3_prefetch_keeps_nccl_order(dp):
    traces = _check(dp, dict(dp=dp), m=2, zero3=True)
    assert sum(op == "all_gather" for _, op, _, _ in traces[0]) > CFG.n_layers  # gathered per layer, prefetched
