"""Mixture of experts and expert parallelism, proven equal to one device.

The layer: router, all-to-all dispatch and combine at ep = 1, 2, 4 give the single-device MoE's
outputs and every gradient (float64), including experts that receive no tokens and ranks that
receive none. The model: trained through the real seam (config -> mesh -> parallelize -> wrap ->
train_step) at ep 2 and 4, and ep 2 composed with dp, tp+sp, pp, cp and ZeRO, to the one-device
weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks, tiers

from minipar.collectives import Group
from minipar.expert_parallel import check_expert_layout, parallelize_experts
from minipar.mesh import Mesh
from minipar.model import ModelConfig, get_config, init_weights
from minipar.moe import MoE, take_load

TIGHT = dict(rtol=1e-10, atol=1e-12)
DIM, TOKENS = 16, 12


def moe_config(n_experts=8, top_k=2, **kw) -> ModelConfig:
    return get_config("tiny-moe", dim=DIM, n_heads=2, n_kv_heads=2, n_experts=n_experts, top_k=top_k,
                      expert_ffn_dim=8, **kw)


def plain_moe(config: ModelConfig, starve: bool) -> MoE:
    moe = MoE(config).double()
    init_weights(moe, config, seed=3)
    if starve:  # every token prefers the first quarter of the experts: the others get nothing
        with torch.no_grad():
            moe.router.weight[config.n_experts // 4:] -= 10.0 * torch.ones(DIM, dtype=torch.float64)
    return moe


def tokens(rank: int, starve: bool):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, TOKENS // 2, DIM, generator=g, dtype=torch.float64)
    if starve:
        x = x.abs() + 0.5  # positive features: the starved experts' scores are pushed far down
    return x.requires_grad_(), torch.randn(2, TOKENS // 2, DIM, generator=g, dtype=torch.float64)


def _layer(rank, world, config, starve):
    with Mesh.build(dp=world) as mesh:
        mesh.unflatten(("dp",), edp=1, ep=world)
        ep = mesh.group("ep")
        moe = plain_moe(config, starve)
        parallelize_experts(moe, ep, None, None, sp=False)
        x, w = tokens(rank, starve)
        y = moe(x)
        (y * w).sum().backward()
        grads = {n: p.grad * (ep.size if "experts" in n else 1) for n, p in moe.named_parameters()}
        chosen = moe.probabilities(x.detach().reshape(-1, DIM)).topk(config.top_k, dim=-1).indices.flatten()
        sent = mesh.ledger.get("ep", "all_to_all").sent if world > 1 else 0
        return y.detach(), x.grad, grads, take_load(moe)[0], (chosen, sent)


@pytest.mark.parametrize("world", tiers([1, 2, 4], fast=2))
@pytest.mark.parametrize("starve", [False, True], ids=["balanced", "starved"])
def test_moe_layer_at_ep_equals_one_device_in_output_and_every_gradient(world, starve):
    config = moe_config()
    ref = plain_moe(config, starve)
    results = run_ranks(world, _layer, config, starve)
    router_grad = 0
    holder = [(c // (config.n_experts // world)) for _, _, _, _, (c, _) in results]  # the rank of each expert
    for rank, (y, x_grad, grads, load, (_, sent)) in enumerate(results):
        # The ledger, against the formula: the counts (E/ep int64 to each other rank), then each row
        # that leaves (a token out, its gradient back) or arrives (a token in, its result's gradient
        # out) crosses once forward and once backward: 2 (rows out + rows in) * d * 8 bytes.
        rows_out = int((holder[rank] != rank).sum())
        rows_in = sum(int((h == rank).sum()) for r, h in enumerate(holder) if r != rank)
        counts = (world - 1) * (config.n_experts // world) * 8
        assert sent == (counts + 2 * (rows_out + rows_in) * DIM * 8 if world > 1 else 0)
        x, w = tokens(rank, starve)
        r = copy.deepcopy(ref)
        y_ref = r(x)
        (y_ref * w).sum().backward()
        torch.testing.assert_close(y, y_ref.detach(), **TIGHT)
        torch.testing.assert_close(x_grad, x.grad, **TIGHT)
        n = config.n_experts // world
        for name in ("w_gate", "w_up", "w_down"):  # the holder's experts: every rank's tokens' gradients
            expected = sum(getattr(copy_of(ref, rk, starve).experts, name).grad for rk in range(world))
            torch.testing.assert_close(grads[f"experts.{name}"], expected[rank * n:(rank + 1) * n], **TIGHT)
        router_grad = router_grad + grads["router.weight"]
        if starve:  # experts 2-7 got no token, so ranks 1.. received none, and no rank sent them any
            assert load[:2] == [TOKENS, TOKENS] and sum(load[2:]) == 0
    expected = sum(copy_of(ref, rk, starve).router.weight.grad for rk in range(world))
    torch.testing.assert_close(router_grad, expected, **TIGHT)


def copy_of(ref: MoE, rank: int, starve: bool) -> MoE:
    """The single-device layer after one backward of `rank`'s tokens."""
    r = copy.deepcopy(ref)
    x, w = tokens(rank, starve)
    (r(x) * w).sum().backward()
    return r


def test_the_aux_loss_pushes_the_router_toward_balance():
    config = moe_config(aux_loss_coef=1.0)
    moe = plain_moe(config, starve=True)
    x, _ = tokens(0, True)
    moe(x).sum().mul(0).backward()  # only the auxiliary loss's gradient
    grad = moe.router.weight.grad
    favoured, starved = slice(0, 2), slice(2, 8)
    # Gradient descent lowers the favoured experts' scores and raises the starved ones'.
    assert (grad[favoured] @ x.detach().mean((0, 1))).min() > 0
    assert (grad[starved] @ x.detach().mean((0, 1))).max() < 0


def test_capacity_drops_what_an_expert_cannot_take_and_dropless_keeps_all():
    config = moe_config(capacity_factor=1.0)
    moe = plain_moe(config, starve=True)
    flat = torch.zeros(TOKENS * 2, dtype=torch.long)  # every assignment to expert 0
    kept = moe.within_capacity(flat)
    assert kept.sum() == 3 and kept[:3].all()  # ceil(1.0 * 24 / 8): the first three, in token order


def test_bad_expert_layouts_are_refused_in_one_line():
    for args, words in [((6, 4, 4), "do not split"), ((8, 4, 2), "must divide dp x cp"),
                        ((0, 2, 2), "needs a mixture-of-experts")]:
        with pytest.raises(ValueError, match=words):
            check_expert_layout(*args)
    with pytest.raises(ValueError, match="top-k 5"):  # the model's own rule (ModelConfig.validate)
        moe_config(n_experts=4, top_k=5).validate()


@pytest.mark.parametrize("argv,words", [
    ("--model tiny-moe --dp 3 --ep 3 --global-batch 24", "4 experts do not split over --ep 3"),
    ("--model tiny-moe --dp 2 --ep 4 --global-batch 16", "--ep 4 must divide dp x cp = 2"),
    ("--model tiny --dp 2 --ep 2", "needs a mixture-of-experts model"),
])
def test_bad_expert_layouts_on_the_command_line_are_refused_before_any_process_group(argv, words, monkeypatch):
    from minipar.ops.command_line import parse_args
    from minipar.run.config import ConfigError

    world = 1
    for flag, value in zip(argv.split()[::2], argv.split()[1::2]):
        world *= int(value) if flag in ("--dp", "--tp", "--pp", "--cp") else 1
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=words.replace("+", r"\+")):
        parse_args(argv.split())


def test_the_logged_expert_load_counts_each_token_once_under_recompute():
    from minipar.model import Llama
    from minipar.parallelize import parallelize

    config = get_config("tiny-moe")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for mode in ({}, dict(recompute=True), dict(recompute_mlp=True)):  # each replays the MoE block in backward
        model = parallelize(Llama(config, 0), **mode)
        model(x, x).backward()
        assert [sum(layer) for layer in take_load(model)] == [2 * 16 * config.top_k] * config.n_layers


def test_a_solo_ep_group_leaves_the_layer_as_it_was():
    config = moe_config()
    moe = plain_moe(config, starve=False)
    before = {n: p.clone() for n, p in moe.state_dict().items()}
    parallelize_experts(moe, Group.solo("ep"), None, None, sp=False)
    assert all(torch.equal(before[n], p) for n, p in moe.state_dict().items())


# ----------------------------------------------------------------------------------------------
# The whole MoE model, trained through the real seam, equals one device
# ----------------------------------------------------------------------------------------------

STEPS, ROWS, SEQ, MICRO = 2, 8, 16, 2
MODEL = dict(n_layers=2, vocab_size=256)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (ROWS, SEQ), generator=g), torch.randint(0, 256, (ROWS, SEQ), generator=g)


def train_config(**layout):
    from minipar.run.config import TrainConfig

    return TrainConfig(model="tiny-moe", seq_len=SEQ, global_batch=ROWS, micro_batch=MICRO, lr=1e-2,
                       weight_decay=0.1, grad_clip=0.5, dtype="float64", **layout)


def single_device():
    from minipar.data_parallel import param_groups
    from minipar.model import Llama
    from minipar.moe import set_aux_scale
    from minipar.parallelize import adamw

    cfg = train_config()
    model = Llama(get_config("tiny-moe", **MODEL), seed=cfg.seed).double()
    opt = adamw(param_groups(model, cfg), cfg.lr)
    for step in range(STEPS):
        x, y = batch(step)
        n = ROWS // MICRO  # the micro-batches of the whole global batch, as the ranks run them
        set_aux_scale(model, 1 / n)
        for xm, ym in zip(x.split(MICRO), y.split(MICRO)):
            (model(xm, ym) / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _train(rank, world, layout):
    from functools import partial

    from minipar.context_parallel import split_sequence
    from minipar.data_parallel import param_groups
    from minipar.parallelize import adamw, build_grad_sync
    from minipar.run.train import build_model, train_step
    from minipar.tensor_parallel import unshard

    cfg = train_config(**layout)
    with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
        if cfg.ep > 1:
            mesh.unflatten(("dp", "cp"), edp=cfg.dp * cfg.cp // cfg.ep, ep=cfg.ep)
        model, pipeline = build_model(cfg, mesh, get_config("tiny-moe", **MODEL), torch.device("cpu"), torch.float64)
        wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr),
                                  zero=cfg.zero, bucket_mb=cfg.bucket_mb, offload=cfg.offload)
        per = ROWS // cfg.dp
        for step in range(STEPS):
            x, y = (t[mesh.coord("dp") * per:(mesh.coord("dp") + 1) * per] for t in batch(step))
            x, y = split_sequence(x, mesh.groups().cp), split_sequence(y, mesh.groups().cp)
            train_step(wrapper, list(zip(x.split(MICRO), y.split(MICRO))), cfg.grad_clip, pipeline=pipeline)
        with wrapper.gathered():
            return {n: unshard(p.detach(), p, mesh.groups()).clone() for n, p in model.named_parameters()}


LAYOUTS = [
    (2, dict(dp=2, ep=2)),
    (4, dict(dp=4, ep=4)),
    (4, dict(dp=4, ep=2)),
    (4, dict(dp=2, ep=2, tp=2, sp=True)),
    (4, dict(dp=2, ep=2, pp=2)),
    (4, dict(cp=2, dp=2, ep=2)),
    (4, dict(dp=4, ep=2, zero=1)),
    (4, dict(dp=4, ep=2, zero=2)),
    (4, dict(dp=4, ep=2, zero=3)),
    (4, dict(dp=2, ep=2, recompute=True, tp=2)),
    (4, dict(dp=2, ep=2, recompute_mlp=True, tp=2, sp=True)),  # selective: the MoE block replayed alone
    (8, dict(dp=2, ep=2, tp=2, sp=True, pp=2)),
]


@pytest.mark.parametrize("world,layout", tiers(LAYOUTS, fast=3),
                         ids=["-".join(f"{k}{v}" for k, v in c[1].items()) for c in LAYOUTS])
def test_moe_model_trained_at_ep_equals_one_device(world, layout):
    ref = single_device()
    params = {}
    for r in run_ranks(world, _train, layout, timeout=300):
        params.update(r)
    assert params.keys() == ref.keys()
    for n, p in ref.items():
        torch.testing.assert_close(params[n], p, **TIGHT, msg=n)


# ----------------------------------------------------------------------------------------------
# Through scripts/train.py: the loss falls, the log shows each expert's load, and a checkpoint
# written at ep 4 resumes at ep 2 and ep 1 with the same losses
# ----------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_train_py_at_ep4_logs_expert_load_and_its_checkpoint_resumes_at_ep2_and_ep1(tmp_path):
    import json

    from test_train import common, losses, run

    moe = dict(model="tiny-moe", micro_batch=2, warmup=2)
    out = run(common(tmp_path, dp=4, ep=4, steps=16, save_every=8, out=tmp_path / "a",
                     log_json=tmp_path / "a.jsonl", **moe), nproc=4).stdout
    assert "experts: the dp x cp ranks as edp 1 x ep 4" in out and "| experts [" in out
    a = losses(tmp_path / "a.jsonl")
    assert sum(a[s] for s in range(13, 17)) < sum(a[s] for s in range(1, 5)) - 0.4  # the loss falls
    record = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[-1])
    load = record["expert_load"]
    assert len(load) == 2 and all(sum(layer) == 2 * 32 * 2 for layer in load)  # rank 0's tokens x top-2
    assert record["comm"]["ep/all_to_all"]["sent"] > 0
    for name, layout, nproc in (("ep2", dict(dp=2, ep=2), 2), ("ep1", dict(dp=1), None)):
        run(common(tmp_path, steps=16, resume=tmp_path / "a" / "step_000008", out=tmp_path / name,
                   log_json=tmp_path / f"{name}.jsonl", **layout, **moe), nproc=nproc)
        b = losses(tmp_path / f"{name}.jsonl")
        assert sorted(b) == list(range(9, 17))
        for step in b:
            assert b[step] == pytest.approx(a[step], rel=1e-9), (name, step)
