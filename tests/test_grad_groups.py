"""The gradient-sync protocol, in plain data parallelism and ZeRO 1/2/3 alike: each parameter's
gradient is averaged over the group its Placement names (grad_mean), and a non-finite gradient
norm skips the step on every rank.

The test places the LM head with grad_mean=("tp",) on a dp=2 mesh (tp = 1): its gradient is then
averaged over no one, while every other parameter is averaged over dp, as expert parameters will
be averaged over their own groups.
"""

import pytest
import torch
from harness import run_ranks
from test_data_parallel import OPT, global_batch

from minipar.data_parallel import param_groups
from minipar.mesh import Groups, Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import build_grad_sync
from minipar.placement import Placement, place
from minipar.run.train import train_step

LOCAL = "lm_head.weight"
ZERO = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def sgd(groups):  # the update is -lr * gradient: which gradient it was shows plainly
    return torch.optim.SGD(groups, lr=0.5)


def _model():
    model = Llama(get_config("tiny"), seed=1).double()
    w = dict(model.named_parameters())[LOCAL]
    place(w, Placement(tuple(w.shape), grad_mean=("tp",)))
    return model


def _step(rank, world, kind):
    with Mesh.build(dp=world) as mesh:
        model = _model()
        wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, OPT), sgd, zero=ZERO[kind], bucket_mb=0.01)
        x, y = global_batch(0)
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        train_step(wrapper, [(x[rows], y[rows])], grad_clip=0.0)
        with wrapper.gathered():
            return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(rows):
    model = _model()
    opt = sgd(param_groups(model, OPT))
    x, y = global_batch(0)
    model(x[rows], y[rows]).backward()
    opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["dp", "zero1", "zero2", "zero3"])
def test_each_parameter_is_averaged_over_the_group_its_placement_names(kind):
    world = 2
    out = run_ranks(world, _step, kind)
    whole = _reference(slice(None))
    for rank, params in enumerate(out):
        x, _ = global_batch(0)
        mine = _reference(slice(rank * len(x) // world, (rank + 1) * len(x) // world))
        for name, p in params.items():
            want = mine[name] if name == LOCAL else whole[name]  # local gradient, or the dp mean
            torch.testing.assert_close(p, want, rtol=1e-10, atol=1e-12, msg=f"{kind} rank {rank} {name}")
    assert not torch.equal(out[0][LOCAL], out[1][LOCAL])  # the ranks' own gradients differed


def _nan_step(rank, world, kind):
    """A backward that makes every gradient NaN: clip_and_step reports it and changes nothing."""
    with Mesh.build(dp=world) as mesh:
        model = Llama(get_config("tiny"), seed=1).double()
        # One plain group for every parameter: Groups made of the dp group alone.
        wrapper = build_grad_sync(model, Groups(dp=mesh.groups().dp), param_groups(model, OPT), sgd, zero=ZERO[kind])
        with wrapper.gathered():
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        x, y = global_batch(0)
        (wrapper(x, y) * float("nan")).backward()
        wrapper.finish_grad_sync()
        norm = wrapper.clip_and_step(1.0)
        with wrapper.gathered():
            same = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return norm != norm, same  # (the norm is NaN, the weights did not move)


@pytest.mark.parametrize("kind", ["dp", "zero1", "zero2", "zero3"])
def test_a_non_finite_gradient_norm_skips_the_step_on_every_rank(kind):
    assert run_ranks(2, _nan_step, kind) == [(True, True), (True, True)]
