"""The estimator (minipar/estimate.py) against published figures and against what ranks hold."""

import pytest
import torch
from harness import run_ranks

from minipar.config import TrainConfig
from minipar.estimate import held_bytes, peak_held_bytes
from minipar.model import get_config
from minipar.zero import model_state_bytes

# ----------------------------------------------------------------------------------------------
# Published figures
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage,gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_the_zero_papers_7_5b_model_on_64_gpus(stage, gigabytes):
    # Rajbhandari et al. (2020), figure 1: Psi = 7.5B, N = 64, K = 12, mixed-precision Adam.
    assert round(model_state_bytes(7.5e9, 64, stage) / 1e9, 1) == gigabytes


@pytest.mark.parametrize("zero", [0, 3])
def test_a_llama_8b_estimate_is_the_papers_formula_with_minipars_bytes_per_parameter(zero):
    # minipar under bf16 autocast keeps fp32 weights and gradients (4 + 4 bytes) and, per
    # parameter, AdamW's two fp32 moments (8); ZeRO adds an fp32 master slice, counted with the
    # weights. Stage 0 (at dp 8, with its flat all-reduce buffers) and stage 3 then follow the
    # paper's shape exactly, up to ZeRO's padding of each bucket to a multiple of N.
    config, n = get_config("8b"), 8
    psi = config.num_params()
    held = held_bytes(config, TrainConfig(model="8b", dp=n, zero=zero, dtype="bfloat16"))
    if zero == 0:
        assert held == {"params": 4 * psi, "grads": 8 * psi, "optimizer": 8 * psi}
    else:
        assert 0 <= sum(held.values()) - model_state_bytes(psi, n, 3, weight=4, grad=4, k=8) < 16 * n * 300


def test_an_estimate_is_arithmetic_even_on_thousands_of_ranks():
    import time

    start = time.perf_counter()
    cfg = TrainConfig(model="8b", dp=512, tp=8, pp=4, zero=1, dtype="bfloat16")  # 16,384 ranks
    psi = get_config("8b").num_params()
    assert 4 * psi / 32 < peak_held_bytes(get_config("8b"), cfg) < 16 * psi / 32  # weights cut 32 ways by tp x pp
    assert time.perf_counter() - start < 10


# ----------------------------------------------------------------------------------------------
# What real ranks hold
# ----------------------------------------------------------------------------------------------

LAYOUTS = [
    (1, dict()),
    (2, dict(dp=2)),
    (2, dict(dp=2, zero=1)),
    (2, dict(dp=2, zero=2)),
    (2, dict(dp=2, zero=3)),
    (2, dict(tp=2)),
    (2, dict(pp=2)),
    (4, dict(dp=2, tp=2, sp=True, zero=1)),
    (4, dict(dp=2, pp=2, zero=2)),
    (4, dict(dp=2, cp=2, zero=3)),
    (4, dict(model="tiny-moe", dp=4, ep=2, zero=1)),
    (2, dict(model="tiny-moe", dp=2, ep=2)),
]


def _measure(rank, world, layout):
    from minipar.mesh import Mesh
    from minipar.train import build_model, train_step, wrap

    cfg = TrainConfig(**{"model": "tiny", "seq_len": 16, "global_batch": 4, "micro_batch": 2, "dtype": "float64",
                         "bucket_mb": 0.01, **layout})
    model_cfg = get_config(cfg.model, vocab_size=250)  # 250: a vocabulary tp must pad
    with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
        if cfg.ep > 1:
            mesh.unflatten(("dp", "cp"), edp=cfg.dp * cfg.cp // cfg.ep, ep=cfg.ep)
        model, pipeline = build_model(cfg, mesh, model_cfg, torch.device("cpu"), torch.float64)
        wrapper = wrap(model, mesh, cfg)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 250, (cfg.global_batch // cfg.dp, cfg.seq_len // cfg.cp), generator=g)
        micro = list(zip(x.split(cfg.micro_batch), x.split(cfg.micro_batch)))
        train_step(wrapper, micro, 1.0, pipeline=pipeline)  # the optimizer state now exists
        with wrapper.no_sync():  # one more backward, measured once its gradients are synced
            if pipeline is not None:
                pipeline.run(model, micro, 1.0)
            else:
                for xm, ym in micro:
                    wrapper(xm, ym, 1.0).backward()
        wrapper.finish_grad_sync()
        pp_rank = pipeline.group.rank if pipeline else 0
        return wrapper.held_bytes(), held_bytes(model_cfg, cfg, pp_rank)


@pytest.mark.parametrize("world,layout", LAYOUTS, ids=["-".join(f"{k}{v}" for k, v in c[1].items()) or "one"
                                                       for c in LAYOUTS])
def test_the_estimate_equals_what_every_rank_holds(world, layout):
    for measured, estimated in run_ranks(world, _measure, layout, timeout=300):
        assert measured == estimated


# ----------------------------------------------------------------------------------------------
# Will it fit? train.py asks before building anything; --plan shows the figures
# ----------------------------------------------------------------------------------------------


def test_a_layout_too_big_is_refused_naming_layouts_of_the_same_ranks_that_fit():
    from minipar.estimate import check_memory

    cfg = TrainConfig(model="1b", dp=4, micro_batch=2, dtype="bfloat16")
    need = peak_held_bytes(get_config("1b", vocab_size=cfg.vocab_size), cfg)
    check_memory(cfg, limit=need)  # exactly enough
    with pytest.raises(ValueError, match=r"needs .* GiB per rank .* with these ranks, --zero 1 or --zero 2 or"):
        check_memory(cfg, limit=need // 2)
    with pytest.raises(ValueError, match="no layout of these ranks fits"):
        check_memory(TrainConfig(model="1b"), limit=2**20)


def test_train_py_refuses_a_model_that_cannot_fit_in_one_line_before_any_process_group(monkeypatch, capsys):
    import minipar.estimate
    import minipar.train

    monkeypatch.setattr(minipar.estimate, "device_memory", lambda: (2**30, "this test's memory"))
    assert minipar.train.main(["--model", "1b", "--no-wandb"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "more than this test's memory (1.0 GiB)" in err[0]
    assert not torch.distributed.is_initialized()


def test_train_py_plan_prints_each_pipeline_ranks_bytes_and_exits(capsys):
    import minipar.train

    assert minipar.train.main(["--model", "1b", "--dp", "2", "--pp", "2", "--micro-batch", "4", "--zero", "1",
                               "--plan"]) == 0
    out = capsys.readouterr().out
    cfg = TrainConfig(model="1b", dp=2, pp=2, micro_batch=4, zero=1)
    for r in range(2):
        held = held_bytes(get_config("1b", vocab_size=cfg.vocab_size), cfg, r)
        assert f"{sum(held.values()) / 2**20:>12,.1f}" in out
    assert not torch.distributed.is_initialized()
