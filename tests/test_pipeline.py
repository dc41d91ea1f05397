"""Pipeline parallelism: every schedule gives the single-device loss and gradients; 3D training."""

import pytest
import torch
from harness import parallel_llama, run_ranks, tiers

from minipar.data_parallel import DataParallel, param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw
from minipar.pipeline.executor import Pipeline, stage_layers
from minipar.run.config import TrainConfig
from minipar.run.train import train_step
from minipar.tensor_parallel import unshard

TIGHT = dict(rtol=1e-10, atol=1e-12)
CFG = get_config("tiny", n_layers=8, vocab_size=250)
B, S = 8, 8


def batch(seed=0, rows=B):
    x = torch.randint(0, 250, (rows, S), generator=torch.Generator().manual_seed(seed))
    return x, torch.roll(x, -1, dims=1)


def stage_model(pipeline, tp_group=None, sp=False):
    return parallel_llama(CFG, seed=3, tp_group=tp_group, sequence_parallel=sp, layer_ids=pipeline.my_layers(),
                 embed=pipeline.holds_first(), head=pipeline.holds_last()).double()


def test_stage_layers_are_balanced_contiguous_and_refuse_too_many_stages():
    assert stage_layers(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stage_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]  # the extra layer goes to the front
    with pytest.raises(ValueError, match="9 pipeline stages .* the model has 8 layers"):
        stage_layers(8, 9)
    assert stage_layers(8, 2, (5, 3)) == [[0, 1, 2, 3, 4], [5, 6, 7]]  # --pp-layers 5,3
    for wrong in ((4, 3), (8, 0), (2, 3, 3)):  # not adding up, an empty stage, a count too many
        with pytest.raises(ValueError, match=f"--pp-layers {','.join(map(str, wrong))}: give 2 counts of 1 or more"):
            stage_layers(8, 2, wrong)


def _one_step(rank, world, schedule, m, v, counts=None):
    with Mesh.build(pp=world) as mesh:
        pipeline = Pipeline(mesh.groups().pp, schedule, CFG.n_layers, v, grad_group=mesh.group("pp", channel="grad"),
                            layer_counts=counts)
        model = stage_model(pipeline)
        x, y = batch()
        loss = pipeline.run(model, list(zip(x.chunk(m), y.chunk(m))), y.numel())  # the batch's mean
        timeline = pipeline.timeline
        return dict(loss=float(loss) if pipeline.holds_last() else None,
                    grads={n: p.grad for n, p in model.named_parameters()},
                    actions=[str(a) for _, _, a in timeline.rows[0]])


def reference():
    model = Llama(CFG, seed=3).double()
    loss = model(*batch())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


SCHEDULES = [("naive", 1, 1), ("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 4, 2),
             ("zb1", 4, 1), ("zb1", 8, 1), ("zbv", 4, 1), ("zbv", 8, 1)]


@pytest.mark.parametrize("pp", tiers([2, 4], fast=1))
@pytest.mark.parametrize("schedule,m,v", tiers(SCHEDULES, fast=[0, 1, 3, 4, 6, 8]),  # each schedule, m 8 if two
                         ids=[f"{s}-m{m}-v{v}" for s, m, v in SCHEDULES])
def test_every_schedule_gives_single_device_loss_and_gradients(pp, schedule, m, v):
    ref_loss, ref_grads = reference()
    out = run_ranks(pp, _one_step, schedule, m, v)
    losses = [r["loss"] for r in out if r["loss"] is not None]
    assert len(losses) == 1 and losses[0] == pytest.approx(ref_loss, rel=1e-12)
    grads = {}
    for r in out:
        assert not grads.keys() & r["grads"].keys()  # each parameter lives on exactly one stage
        grads.update(r["grads"])
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **TIGHT, msg=name)


def test_stages_of_their_own_sizes_give_the_single_device_loss_and_gradients():
    ref_loss, ref_grads = reference()
    out = run_ranks(2, _one_step, "1f1b", 4, 1, (6, 2))  # --pp-layers 6,2: the head's stage holds 2 layers
    assert [r["loss"] for r in out][1] == pytest.approx(ref_loss, rel=1e-12)
    assert sorted(n for n in out[1]["grads"] if n.startswith("layers.")) == sorted(
        n for n in ref_grads if n.startswith(("layers.6.", "layers.7.")))
    grads = {n: g for r in out for n, g in r["grads"].items()}
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **TIGHT, msg=name)


# ----------------------------------------------------------------------------------------------
# dp2 x tp2 x pp2 on 8 ranks: training steps equal one device
# ----------------------------------------------------------------------------------------------

OPT = TrainConfig(lr=1e-2, weight_decay=0.1)
STEPS = 2


def single_device_training():
    model = Llama(CFG, seed=3).double()
    opt = adamw(param_groups(model, OPT), OPT.lr)
    for step in range(STEPS):
        model(*batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _three_d(rank, world, schedule, sp):
    with Mesh.build(dp=2, tp=2, pp=2) as mesh:
        pipeline = Pipeline(mesh.groups().pp, schedule, CFG.n_layers, 2 if schedule == "interleaved" else 1,
                            grad_group=mesh.group("pp", channel="grad"), seq_shards=2 if sp else 1)
        model = stage_model(pipeline, mesh.groups().tp, sp)
        dp_model = DataParallel(model, mesh.groups(), optimizer=adamw(param_groups(model, OPT), OPT.lr))
        per = B // 2
        for step in range(STEPS):
            x, y = batch(step)
            mine = slice(mesh.coord("dp") * per, (mesh.coord("dp") + 1) * per)
            x, y = x[mine], y[mine]
            train_step(dp_model, list(zip(x.chunk(2), y.chunk(2))), 0.5, pipeline=pipeline)
        return {n: unshard(p.detach(), p, mesh.groups().tp) for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule,sp", tiers([("1f1b", False), ("interleaved", True), ("zb1", True)], fast=1))
def test_dp2_tp2_pp2_training_equals_single_device(schedule, sp):
    ref = single_device_training()
    params = {}
    for r in run_ranks(8, _three_d, schedule, sp, timeout=300):
        for name, p in r.items():
            if name in params:  # dp and tp replicas hold the same values
                torch.testing.assert_close(p, params[name], **TIGHT)
            params[name] = p
    assert params.keys() == ref.keys()
    for name, p in ref.items():
        torch.testing.assert_close(params[name], p, **TIGHT, msg=name)
