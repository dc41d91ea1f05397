"""Hand-written data parallelism equals one device on the whole batch, and PyTorch's DDP."""

import copy
from contextlib import nullcontext

import pytest
import torch
from harness import run_ranks, tiers
from torch.nn.parallel import DistributedDataParallel as DDP

from minipar.data_parallel import DataParallel, param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw
from minipar.run.config import TrainConfig
from minipar.run.train import train_step

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
OPT = TrainConfig(lr=1e-2, weight_decay=0.1)


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def new_model():
    return Llama(get_config("tiny"), seed=1).double()


def single_device_params():
    """The plain computation: the whole global batch on one model, no accumulation."""
    model = new_model()
    opt = adamw(param_groups(model, OPT), OPT.lr)
    for step in range(STEPS):
        x, y = global_batch(step)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _dp_run(rank, world, accum):
    with Mesh.build(dp=world) as mesh:
        model = new_model()
        ddp_model = DDP(copy.deepcopy(model), process_group=mesh.groups().dp.pg)
        dp_model = DataParallel(model, mesh.groups(), bucket_mb=0.02, optimizer=adamw(param_groups(model, OPT), OPT.lr))
        ddp_opt = adamw(param_groups(ddp_model.module, OPT), OPT.lr)  # several buckets, above
        per_rank = GLOBAL_BATCH // world
        psi_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ledgers, launched_in_backward = [], []
        for step in range(STEPS):
            x, y = global_batch(step)
            x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
            micro = list(zip(x.chunk(accum), y.chunk(accum)))

            mesh.ledger.reset()
            train_step(dp_model, micro, grad_clip=1.0)
            ledgers.append(mesh.ledger.get("dp", "all_reduce"))

            for i, (mx, my) in enumerate(micro):  # the same step with PyTorch's DDP
                with ddp_model.no_sync() if i < accum - 1 else nullcontext():
                    (ddp_model(mx, my) / accum).backward()
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            ddp_opt.step()
            ddp_opt.zero_grad()

        # Overlap: one more backward, stopped before finish_grad_sync: buckets are already in flight.
        mesh.ledger.reset()
        model(*micro[0]).backward()
        launched_in_backward = mesh.ledger.get("dp", "all_reduce").calls
        dp_model.finish_grad_sync()
        return dict(
            params={n: p.detach() for n, p in model.named_parameters()},
            ddp={n: p.detach() for n, p in ddp_model.module.named_parameters()},
            ledgers=[(e.calls, e.bytes, e.sent) for e in ledgers],
            psi_bytes=psi_bytes,
            buckets=len(dp_model.buckets),
            launched_in_backward=launched_in_backward,
        )


@pytest.mark.parametrize("world,accum", tiers([(2, 1), (2, 2), (4, 1), (4, 2)], fast=3))
def test_dp_params_after_adamw_steps_equal_single_device_and_ddp(world, accum):
    reference = single_device_params()
    for r in run_ranks(world, _dp_run, accum):
        for name, ref in reference.items():
            torch.testing.assert_close(r["params"][name], ref, rtol=1e-10, atol=1e-12, msg=name)
            torch.testing.assert_close(r["params"][name], r["ddp"][name], rtol=1e-10, atol=1e-12, msg=name)
        # Exactly one all-reduce of every gradient per optimizer step, whatever the accumulation:
        # the k-1 micro-batches inside no_sync sent nothing. (And 8 bytes first: the step's count
        # of real targets, train_step's loss divisor.)
        for calls, nbytes, _sent in r["ledgers"]:
            assert r["buckets"] > 1 and calls == r["buckets"] + 1
            assert nbytes == r["psi_bytes"] + 8
        # ...and the buckets were launched during backward, not after it.
        assert 0 < r["launched_in_backward"] <= r["buckets"]


def test_dp_replicas_start_identical_from_rank0_weights():
    out = run_ranks(2, _broadcast_check)
    assert out[0] == out[1] == 0.0


def _broadcast_check(rank, world):
    with Mesh.build(dp=world) as mesh:
        model = Llama(get_config("tiny"), seed=rank).double()  # different weights on purpose
        DataParallel(model, mesh.groups())
        ref = Llama(get_config("tiny"), seed=0).double()
        return max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def _synced_backward_twice(rank, world):
    with Mesh.build(dp=world) as mesh:
        model = DataParallel(new_model(), mesh.groups())
        x, y = global_batch(0)
        model(x, y).backward()
        try:
            model(x, y).backward()  # accumulation without no_sync: refused, never silently wrong
        except RuntimeError as e:
            return str(e)
        finally:
            model.finish_grad_sync()


def test_accumulating_without_no_sync_is_refused_not_silently_wrong():
    for msg in run_ranks(2, _synced_backward_twice):
        assert "inside model.no_sync()" in msg


@pytest.mark.parametrize("zero", [0, 2])
def test_a_dropped_wrapper_is_freed_with_its_groups(zero):
    """The wrappers' gradient hooks live on the parameters, in C++, where Python's collector cannot
    see a cycle: a hook holding the wrapper strongly kept every wrapper, and the gloo threads of its
    groups, alive for the life of the process. The hooks hold it weakly, so a dropped one goes."""
    import gc
    import weakref

    from minipar.mesh import Groups
    from minipar.parallelize import build_grad_sync

    model = Llama(get_config("tiny", vocab_size=64))
    wrapper = build_grad_sync(model, Groups(), [{"params": list(model.parameters())}], adamw_lr, zero=zero)
    model(torch.randint(0, 64, (1, 8))).sum().backward()  # the hooks run, and still do not hold it
    gone = weakref.ref(wrapper)
    del wrapper
    gc.collect()
    assert gone() is None


def adamw_lr(groups):
    return adamw(groups, lr=1e-3)
