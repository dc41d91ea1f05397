"""The estimator knows Muon (minipar/planning/estimate_muon.py, estimate.held_bytes): every rank's bytes held
(one momentum buffer a Muon matrix, AdamW's two moments for the rest) and bytes sent, key by key and rank by
rank, equal what a real step holds and the ledger counts, under each --muon-method; the owners' Newton-Schulz
FLOPs are balanced; --plan prints Muon's state, not AdamW's."""

from functools import partial

import pytest
import torch
from harness import run_ranks_once, tiers

from minipar.model import get_config
from minipar.planning.estimate import held_bytes
from minipar.planning.estimate_muon import ns_flops_per_rank
from minipar.planning.traffic import bytes_sent
from minipar.run.config import TrainConfig


def _measure(rank, world, layout):
    """(what this rank holds once gradients are synced after a step, the estimate; the ledger of a second
    step's bytes sent, the estimate for this dp rank), as test_estimate._measure and _a_steps_ledger."""
    from minipar.mesh import Mesh
    from minipar.parallelize import build_grad_sync, optimizer_of
    from minipar.precision import of_config
    from minipar.run.train import build_model, train_step

    cfg = TrainConfig(**{"model": "tiny", "seq_len": 16, "global_batch": 4, "micro_batch": 2, "dtype": "float64",
                         "bucket_mb": 0.01, "optimizer": "muon", **layout})
    model_cfg = get_config(cfg.model, vocab_size=250, n_layers=cfg.n_layers or 2)
    with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
        model, pipeline = build_model(cfg, mesh, model_cfg, torch.device("cpu"), torch.float64)
        wrapper = build_grad_sync(model, mesh.groups(), *optimizer_of(model, cfg, mesh.groups()), zero=cfg.zero,
                                  bucket_mb=cfg.bucket_mb, precision=of_config(cfg))
        x = torch.randint(0, 250, (cfg.global_batch // cfg.dp, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        micro = list(zip(x.split(cfg.micro_batch), x.split(cfg.micro_batch)))
        step = partial(train_step, wrapper, micro, 1.0, pipeline=pipeline)
        step()
        mesh.ledger.reset()
        step()  # a step like every other
        sent = {k: v["sent"] for k, v in mesh.ledger.snapshot().items() if v["sent"]}
        with wrapper.no_sync():  # one more backward, measured once its gradients are synced
            for xm, ym in micro:
                wrapper(xm, ym, 1.0).backward()
        wrapper.finish_grad_sync()
        pp_rank, dp_rank = pipeline.group.rank if pipeline else 0, mesh.coord("dp")
        return (wrapper.held_bytes(), held_bytes(model_cfg, cfg, pp_rank)), (sent, bytes_sent(model_cfg, cfg, pp_rank,
                                                                                               dp_rank))


LAYOUTS = [(1, dict()), (2, dict(dp=2)), (2, dict(tp=2)),
           *[(w, dict(dp=w, zero=z, muon_method=m, micro_batch=4 // w)) for w, z in ((2, 1), (4, 2), (2, 3))
             for m in ("gather", "owner", "whole")],
           (4, dict(dp=2, tp=2, sp=True, zero=1, muon_method="owner")),
           (4, dict(dp=2, tp=2, sp=True, zero=1, muon_method="gather"))]
IDS = ["-".join(f"{k}{v}" for k, v in layout.items()) or "one" for _, layout in LAYOUTS]


@pytest.mark.parametrize("world,layout", tiers(LAYOUTS, fast=[4, 9]), ids=IDS)
def test_muons_estimated_bytes_held_equal_what_every_rank_holds(world, layout):
    for (measured, estimated), _ in run_ranks_once(world, _measure, layout, timeout=300):
        assert measured == estimated


@pytest.mark.parametrize("world,layout", tiers(LAYOUTS, fast=[4, 9]), ids=IDS)
def test_muons_estimated_bytes_sent_equal_the_ledger_rank_by_rank(world, layout):
    for _, (measured, estimated) in run_ranks_once(world, _measure, layout, timeout=300):
        assert measured == estimated


def test_muon_holds_one_momentum_buffer_where_adamw_holds_two_moments():
    c, cfg = get_config("8b"), TrainConfig(model="8b", dp=8, zero=1, dtype="bfloat16")
    muon = sum(p.numel() for n, p in _paper(c).named_parameters() if n.startswith("layers.") and p.dim() == 2)
    adamw, ours = held_bytes(c, cfg)["optimizer"], held_bytes(c, TrainConfig(**{**vars(cfg), "optimizer": "muon"}))
    assert adamw - ours["optimizer"] == pytest.approx(4 * muon / 8, rel=1e-3)  # one fp32 slot of 1/8 of them


def _paper(c):
    with torch.device("meta"):
        from minipar.model import Llama

        return Llama(c, seed=0)


def test_the_owner_method_spreads_newton_schulz_where_gather_repeats_it():
    """8B over 8 dp ranks, ZeRO-1: gather orthogonalises every matrix a slice touches (about 1/8 of
    them and those it shares), owner each matrix once, on its owner: every rank near 1/8 of all."""
    owner, gather = (ns_flops_per_rank(get_config("8b"), TrainConfig(model="8b", dp=8, zero=1, dtype="bfloat16",
                                                                    optimizer="muon", muon_method=m))
                     for m in ("owner", "gather"))
    assert sum(gather) > sum(owner) and max(owner) <= 1.1 * sum(owner) / 8


def test_plan_prints_muons_state_and_its_extra_bytes():
    from minipar.planning.planner import report

    adamw = TrainConfig(model="tiny", dp=2, zero=1, bucket_mb=0.01)
    text = report(TrainConfig(**{**vars(adamw), "optimizer": "muon", "muon_method": "owner"}))
    assert text != report(adamw) and "Muon" in text and "dp/all_to_all" in text


def test_the_planners_clock_weighs_muons_method_newton_schulz_and_messages():
    """8B on 64 H100s at dp 64, ZeRO-1: gather repeats Newton-Schulz on every rank and sends every matrix,
    owner spreads both; the clock's step is AdamW's plus what each method adds."""
    from minipar.planning.planner import Cluster, step_time

    c, base = get_config("8b"), dict(model="8b", dp=64, zero=1, precision="bf16-mixed", seq_len=4096,
                                     global_batch=64, micro_batch=1)
    cfgs = {m: TrainConfig(**base, optimizer="muon" if m else "adamw", **({"muon_method": m} if m else {}))
            for m in (None, "gather", "owner")}
    time = {m: step_time(c, cfg, Cluster(64))["total"] for m, cfg in cfgs.items()}
    assert time[None] < time["owner"] < time["gather"]


def test_the_planner_weighs_muon_and_picks_it_where_its_one_buffer_fits_a_faster_layout():
    """1B on 8 GPUs of 8 GB: AdamW's two moments force recompute; Muon's one buffer lets ZeRO-3 run without it,
    faster. Asked to weigh both, the planner ranks them together and picks Muon with its method; asked for
    AdamW alone (the default: the optimizer changes the training, so it is the user's to ask), never Muon."""
    from dataclasses import replace

    from minipar.planning.estimate import peak_bytes
    from minipar.planning.planner import Cluster, plan

    cluster, c = Cluster(8, memory=8e9), get_config("1b")
    adamw, _ = plan("1b", cluster, 4096, 64, 1, ("adamw",))
    both, _ = plan("1b", cluster, 4096, 64, 1, ("adamw", "muon"))
    assert adamw and all(ch.cfg.optimizer == "adamw" for ch in adamw)
    best = both[0]
    assert best.cfg.optimizer == "muon" and best.time["total"] < adamw[0].time["total"], (best.flags(), adamw[0])
    assert peak_bytes(c, replace(best.cfg, optimizer="adamw", muon_method="gather")) > cluster.usable
    assert "--optimizer muon --muon-method owner" in best.flags()  # the method is the planner's choice too
    methods = {(ch.cfg.muon_method, ch.cfg.zero > 0) for ch in both if ch.cfg.optimizer == "muon"}
    assert methods == {("gather", False), ("gather", True), ("owner", True), ("whole", True)}  # methods need ZeRO


def test_the_clock_does_not_hide_muons_messages_behind_backward():
    """Muon's gathers come in the optimizer's step, after backward: a step long enough to hide all of
    AdamW's dp traffic still pays every byte of Muon's, at the link's bandwidth."""
    from minipar.planning.estimate import rank_model, zero_buckets
    from minipar.planning.estimate_muon import muon_messages
    from minipar.planning.planner import Cluster, step_time

    c, cluster = get_config("8b"), Cluster(64)
    base = dict(model="8b", dp=64, zero=1, precision="bf16-mixed", seq_len=4096, global_batch=1024, micro_batch=1)
    assert step_time(c, TrainConfig(**base), cluster)["dp"] == 0  # AdamW's reduce-scatter and gather: hidden
    cfg = TrainConfig(**base, optimizer="muon")
    model = rank_model(c, cfg)
    sent = sum(n for key, n in muon_messages(model, cfg, zero_buckets(model, cfg)) if key.startswith("dp/"))
    assert sent > 0 and step_time(c, cfg, cluster)["dp"] == pytest.approx(sent / cluster.inter_bandwidth, rel=1e-9)


def test_plan_py_weighs_both_optimizers_when_asked(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--model", "1b", "--gpu-memory", "8GB", "--seq-len", "4096", "--global-batch", "64",
                 "--optimizer", "both"])
    out = capsys.readouterr().out
    assert "The choice: --dp 2 --tp 4 --sp --zero 3 --optimizer muon --muon-method owner." in out
    assert "  AdamW: best is --dp 2 --tp 4 --sp --zero 1 --recompute-selective" in out
    assert "  Muon, --muon-method whole: best is" in out
