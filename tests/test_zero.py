"""ZeRO-1 and ZeRO-2 equal one device and PyTorch's ZeroRedundancyOptimizer, hold 1/N of the
optimizer state (and, stage 2, of the gradients), and send 2 Psi (N-1)/N per step."""

import pytest
import torch
from harness import parallel_llama, run_ranks, run_ranks_once, tiers
from test_data_parallel import GLOBAL_BATCH, OPT, STEPS, global_batch, new_model, single_device_params
from torch.distributed.optim import ZeroRedundancyOptimizer

from minipar.collectives import ring_bytes_sent
from minipar.data_parallel import param_groups
from minipar.mesh import Groups, Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import BETAS, EPS, adamw
from minipar.run.train import train_step
from minipar.tensor_parallel import unshard
from minipar.zero import ZeroDataParallel

TIGHT = dict(rtol=1e-10, atol=1e-12)


def zero_model(model, groups, stage, bucket_mb=0.02):
    return ZeroDataParallel(model, groups, stage, lambda pgs: adamw(pgs, OPT.lr), param_groups(model, OPT), bucket_mb)


def _zero_run(rank, world, stage, accum):
    with Mesh.build(dp=world) as mesh:
        model = new_model()
        zero = zero_model(model, mesh.groups(), stage)
        # PyTorch's ZeRO-1 on a second copy, same data (stage 1 only).
        ref_model = new_model()
        ref_opt = ZeroRedundancyOptimizer(param_groups(ref_model, OPT), optimizer_class=torch.optim.AdamW,
                                          process_group=mesh.groups().dp.pg, lr=OPT.lr, betas=BETAS, eps=EPS)
        per = GLOBAL_BATCH // world
        psi = sum(p.numel() for p in model.parameters())
        ledgers = []
        for step in range(STEPS):
            x, y = global_batch(step)
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            micro = list(zip(x.chunk(accum), y.chunk(accum)))
            mesh.ledger.reset()
            train_step(zero, micro, grad_clip=1.0)
            ledgers.append({k: v["sent"] for k, v in mesh.ledger.snapshot().items()})
            if stage == 1:  # the same step with PyTorch's ZeroRedundancyOptimizer
                for mx, my in micro:
                    (ref_model(mx, my) / accum).backward()
                for p in ref_model.parameters():
                    torch.distributed.all_reduce(p.grad, group=mesh.groups().dp.pg)
                    p.grad /= world
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
                ref_opt.step()
                ref_opt.zero_grad()
        between_steps = zero.gradient_bytes()
        # One more backward, measured once its gradients are reduce-scattered (before the update).
        model(*micro[0]).backward()
        zero.finish_grad_sync()
        after_backward = zero.gradient_bytes()
        full_grads = [p.grad for p in model.parameters() if p.grad is not None]
        return dict(
            params={n: p.detach() for n, p in model.named_parameters()},
            zro={n: p.detach() for n, p in ref_model.named_parameters()},
            ledgers=ledgers, psi=psi,
            opt_bytes=zero.optimizer_state_bytes(), grad_bytes=after_backward, between_steps=between_steps,
            full_grads=full_grads, padded=sum(b.padded for b in zero.buckets),
        )


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world,accum", tiers([(2, 1), (2, 2), (4, 1), (4, 2)], fast=1))
def test_zero_params_after_adamw_steps_equal_single_device(stage, world, accum):
    reference = single_device_params()
    for r in run_ranks_once(world, _zero_run, stage, accum):
        for name, ref in reference.items():
            torch.testing.assert_close(r["params"][name], ref, **TIGHT, msg=name)


@pytest.mark.parametrize("world", tiers([2, 4], fast=0))  # make test: the run the test above read
def test_zero1_equals_torch_zero_redundancy_optimizer(world):
    for r in run_ranks_once(world, _zero_run, 1, 2):
        for name, p in r["params"].items():
            torch.testing.assert_close(p, r["zro"][name], **TIGHT, msg=name)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", tiers([2, 4], fast=1))
def test_memory_and_communication_per_rank(stage, world):
    for r in run_ranks_once(world, _zero_run, stage, 1):
        # Adam's two moments for this rank's slices only: 2 * Psi / N (plus padding to N).
        assert r["opt_bytes"] == 2 * r["padded"] * 8 // world
        # After backward no full gradient is left, only this rank's slice; between steps, nothing.
        assert r["full_grads"] == []
        assert r["grad_bytes"] == r["padded"] * 8 // world
        assert r["between_steps"] == 0
        # Per step: reduce-scatter and all-gather of Psi (padded to N per bucket), (N-1)/N each:
        # 2 Psi (N-1)/N in all, the same as data parallelism's all-reduce.
        assert 0 <= r["padded"] - r["psi"] < world * 100
        for sent in r["ledgers"]:
            rs, ag = sent["dp/reduce_scatter"], sent["dp/all_gather"]
            assert rs == ag == (world - 1) * r["padded"] * 8 // world
            # Besides, two float64 all-reduces: the batch's count of real targets (train_step's
            # loss divisor) and the squared gradient norm of the slices.
            assert sent["dp/all_reduce"] == 2 * ring_bytes_sent("all_reduce", 8, world)
            assert set(sent) == {"dp/reduce_scatter", "dp/all_gather", "dp/all_reduce"}


def _zero_tp(rank, world, stage):
    with Mesh.build(dp=2, tp=2) as mesh:
        cfg = get_config("tiny", vocab_size=250)
        model = parallel_llama(cfg, seed=5, tp_group=mesh.groups().tp, sequence_parallel=True).double()
        zero = zero_model(model, mesh.groups(), stage)
        for step in range(2):
            x = torch.randint(0, 250, (4, 8), generator=torch.Generator().manual_seed(step))
            y = torch.roll(x, -1, dims=1)
            rows = slice(mesh.coord("dp") * 2, mesh.coord("dp") * 2 + 2)
            train_step(zero, [(x[rows], y[rows])], 0.5)
        return {n: unshard(p.detach(), p, mesh.groups().tp) for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", tiers([1, 2], fast=1))
def test_zero_with_tp2_and_sequence_parallel_equals_single_device(stage):
    cfg = get_config("tiny", vocab_size=250)
    model = Llama(cfg, seed=5).double()
    opt = adamw(param_groups(model, OPT), OPT.lr)
    for step in range(2):
        x = torch.randint(0, 250, (4, 8), generator=torch.Generator().manual_seed(step))
        model(x, torch.roll(x, -1, dims=1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    for r in run_ranks(4, _zero_tp, stage):
        for n, p in model.named_parameters():
            torch.testing.assert_close(r[n], p.detach(), **TIGHT, msg=n)


def test_stage_3_is_refused_not_faked():
    with pytest.raises(ValueError, match="stage 3 is not built"):
        ZeroDataParallel(new_model(), Groups(), 3, None, [])


def test_recompute_gives_identical_gradients():
    cfg = get_config("tiny", vocab_size=250)
    grads = []
    for recompute in (False, True):
        model = parallel_llama(cfg, seed=5, recompute=recompute).double()
        x = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(0))
        model(x, torch.roll(x, -1, dims=1)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def _offload(rank, world, offload):
    with Mesh.build(dp=world) as mesh:
        model = new_model()
        zero = ZeroDataParallel(model, mesh.groups(), 2, lambda pgs: adamw(pgs, OPT.lr), param_groups(model, OPT),
                                bucket_mb=0.02, offload=offload)
        for step in range(STEPS):
            x, y = global_batch(step)
            train_step(zero, [(x[rank::world], y[rank::world])], grad_clip=1.0)
        return dict(params={n: p.detach() for n, p in model.named_parameters()},
                    where={str(b.master.device) for b in zero.buckets})


def test_offload_on_and_off_give_identical_parameters():
    on, off = run_ranks(2, _offload, True), run_ranks(2, _offload, False)
    assert on[0]["where"] == {"cpu"}
    for name, p in off[0]["params"].items():
        assert torch.equal(p, on[0]["params"][name]), name


def _zero_state_round_trip(rank, world):
    with Mesh.build(dp=world) as mesh:
        model = new_model()
        zero = zero_model(model, mesh.groups(), 2)
        x, y = global_batch(0)
        train_step(zero, [(x[rank::world], y[rank::world])], grad_clip=1.0)
        states = zero.state_by_name()  # every slice joined: the unsharded optimizer's state
        fresh = zero_model(new_model(), mesh.groups(), 2)
        fresh.load_state_by_name(states)
        for b, fb in zip(zero.buckets, fresh.buckets):
            for slot in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(zero.optimizer.state[b.master][slot], fresh.optimizer.state[fb.master][slot])
        return {n: {k: v.shape for k, v in s.items()} for n, s in states.items()}


def test_zero_optimizer_state_by_name_round_trips_and_has_parameter_shapes():
    shapes = run_ranks(4, _zero_state_round_trip)[0]
    for n, p in new_model().named_parameters():
        assert shapes[n]["exp_avg"] == p.shape and shapes[n]["exp_avg_sq"] == p.shape


def _zero_pp(rank, world, stage):
    from minipar.pipeline.executor import Pipeline

    with Mesh.build(dp=2, pp=2) as mesh:
        cfg = get_config("tiny", n_layers=4, vocab_size=250)
        pipeline = Pipeline(mesh.groups().pp, "1f1b", cfg.n_layers)
        model = parallel_llama(cfg, seed=5, layer_ids=pipeline.my_layers(), embed=pipeline.holds_first(),
                      head=pipeline.holds_last()).double()
        zero = zero_model(model, mesh.groups(), stage)
        for step in range(2):
            x = torch.randint(0, 250, (8, 8), generator=torch.Generator().manual_seed(step))
            y = torch.roll(x, -1, dims=1)
            rows = slice(mesh.coord("dp") * 4, mesh.coord("dp") * 4 + 4)
            train_step(zero, list(zip(x[rows].chunk(2), y[rows].chunk(2))), 0.5, pipeline=pipeline)
        return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", tiers([1, 2], fast=0))
def test_zero_with_pipeline_pp2_equals_single_device(stage):
    cfg = get_config("tiny", n_layers=4, vocab_size=250)
    model = Llama(cfg, seed=5).double()
    opt = adamw(param_groups(model, OPT), OPT.lr)
    for step in range(2):
        x = torch.randint(0, 250, (8, 8), generator=torch.Generator().manual_seed(step))
        model(x, torch.roll(x, -1, dims=1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    params = {}
    for r in run_ranks(4, _zero_pp, stage):
        params.update(r)
    for n, p in model.named_parameters():
        torch.testing.assert_close(params[n], p.detach(), **TIGHT, msg=n)
