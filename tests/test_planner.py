"""The layout planner (minipar/planning/planner.py, scripts/tools/plan.py): it picks what practitioners pick."""

import functools
import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import pytest

from minipar.comm_clock import exposed_line
from minipar.model import get_config
from minipar.pipeline.schedules import build
from minipar.pipeline.timeline import simulate
from minipar.planning.estimate import peak_bytes, replayed_bytes
from minipar.planning.planner import (
    Cluster,
    check_memory,
    layouts,
    messages,
    plan,
    report,
    step_flops,
    step_time,
)
from minipar.planning.traffic import bytes_sent
from minipar.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def plan_8b(headroom: float = 0.1):
    """Chapter 8's 8b question: one node of 8 H100s of 80 GB, 8,192 tokens, 1,024 sequences a step."""
    return plan("8b", Cluster(8, headroom=headroom), seq_len=8192, global_batch=1024)


def test_an_8b_llama_on_one_node_of_8_gpus_is_sharded_data_parallelism_where_the_whole_80_gb_may_be_used():
    every, _ = plan_8b(headroom=0)
    best = every[0]  # FSDP-like: no model cut (tp, pp); the 8K sequence split (cp)
    assert best.flags() == "--dp 4 --cp 2 --zero 3" and 72e9 < best.memory <= 80e9
    # It needs 73.7 GB: with a tenth of the memory kept free, the fastest of the rest is torchtitan's own
    # Llama-3 8B recipe: FSDP over the 8 GPUs with selective recompute (its matmuls' outputs kept, the
    # cheap ops redone). The fastest that keeps every activation cuts 4 pipeline stages and pays a bubble.
    fits, _ = plan_8b()
    assert [ch.flags() for ch in fits] == [ch.flags() for ch in every if ch.memory <= 72e9]
    assert fits[0].flags() == "--dp 8 --zero 3 --recompute-selective", fits[0].flags()
    kept_all = next(ch for ch in fits if not (ch.cfg.recompute or ch.cfg.recompute_mlp or ch.cfg.recompute_selective))
    assert kept_all.flags() == "--pp 4 --cp 2 --zero 1" and kept_all.time["bubble"] > 0, kept_all.flags()


def test_the_planner_weighs_zero3_with_recompute_torchtitans_8b_shape_fits_where_zero3_alone_does_not():
    # torchtitan's Llama-3 8B recipe: FSDP over 8 GPUs, 8,192 tokens, no tp, pp or cp, activation
    # checkpointing. Without recompute a step's activations do not fit beside ZeRO-3's states.
    fits, _ = plan_8b()
    fsdp = [ch for ch in fits if ch.cfg.dp == 8 and ch.cfg.zero == 3]
    assert [ch.flags() for ch in fsdp] == ["--dp 8 --zero 3 --recompute-selective", "--dp 8 --zero 3 --recompute-mlp",
                                           "--dp 8 --zero 3 --recompute"]
    selective, mlp, full = fsdp
    c, cluster = get_config("8b"), Cluster(8)
    plain = step_flops(c, replace(full.cfg, recompute=False)) / (8 * cluster.flops * cluster.mfu)
    # Whole layers: every forward again, 8/6 of the compute. The MLPs: their three matmuls again. The
    # cheap ops: no matmul, only the bytes the replay rebuilds, written and read at HBM's bandwidth.
    assert full.time["compute"] == pytest.approx(8 / 6 * plain)
    replay = 2 * replayed_bytes(c, selective.cfg) * 32 * selective.cfg.accum_steps / cluster.memory_bandwidth
    assert selective.time["compute"] == pytest.approx(plain + replay)
    assert plain < selective.time["compute"] < mlp.time["compute"] < full.time["compute"]


@functools.cache
def plan_70b():
    """scripts/tools/plan.py's 70b question (README): 64 GPUs of 80 GB, 8 a node, 8,192 tokens, 1,024 sequences a
    step."""
    return plan("70b", Cluster(64), seq_len=8192, global_batch=1024)


def test_a_70b_llama_on_64_gpus_uses_tensor_parallelism_inside_nodes_plus_pipeline_stages():
    fits, too_big = plan_70b()
    best = fits[0].cfg
    assert 1 < best.tp <= 8 and best.pp > 1, fits[0].flags()
    assert too_big > 0 and not any(ch.cfg.dp == 64 and ch.cfg.zero == 0 for ch in fits)  # replicas do not fit


def test_for_70b_on_64_gpus_selective_recompute_fits_the_fastest_layout_and_recomputing_the_mlps_is_slower():
    # The capstone (docs/11_capstone.md). Whole-layer recompute redoes every forward (8/6 of the
    # compute); recompute of the MLPs redoes their matmuls (+6·d·ffn a token and layer), the most
    # expensive part of a layer; selective recompute redoes the cheap ops (and under ring attention,
    # one node of its own, the scores: +4·d·s a token and layer) and keeps every matmul's output.
    fits, _ = plan_70b()
    selective, mlp, full = (next(ch for ch in fits if getattr(ch.cfg, mode))
                            for mode in ("recompute_selective", "recompute_mlp", "recompute"))
    assert fits[0] is selective and 72e9 > selective.memory
    assert selective.flags() == "--tp 2 --pp 8 --cp 4 --sp --zero 1 --recompute-selective", selective.flags()
    assert mlp.flags() == "--tp 2 --pp 8 --cp 4 --sp --zero 1 --recompute-mlp", mlp.flags()
    assert full.flags() == "--dp 2 --pp 8 --cp 4 --zero 1 --recompute", full.flags()
    assert mlp.time["total"] - selective.time["total"] > 20 and full.time["total"] > mlp.time["total"]
    c = get_config("70b")
    tokens, mlps = 1024 * 8192, 80 * 6 * c.dim * c.ffn_dim  # the MLPs' forward again: 2 x 3·d·ffn a token and layer
    flops = tokens * c.flops_per_token(8192)
    assert mlp.time["compute"] == pytest.approx((flops + tokens * mlps) / (64 * 989e12 * 0.45))
    scores = tokens * 80 * 4 * c.dim * 8192
    replay = 2 * replayed_bytes(c, selective.cfg) * 10 * selective.cfg.accum_steps / 3.35e12  # 10 layers a stage
    assert selective.time["compute"] == pytest.approx((flops + scores) / (64 * 989e12 * 0.45) + replay)
    # The same layout without its recompute does not fit in the GPU's 80 GB: it fits only with it.
    plain = replace(selective.cfg, recompute_selective=False)
    assert peak_bytes(c, plain) > 80e9 and plain not in [ch.cfg for ch in fits]
    # What keeps every activation pays tp 8 over it, more than the replay costs.
    kept_all = next(ch for ch in fits if not (ch.cfg.recompute or ch.cfg.recompute_mlp or ch.cfg.recompute_selective))
    assert kept_all.flags() == "--tp 8 --pp 2 --cp 4 --sp --zero 1", kept_all.flags()
    assert kept_all.time["tp"] > selective.time["compute"] - kept_all.time["compute"]


def test_tensor_parallelism_never_leaves_a_node():
    for cfg in layouts("1b", Cluster(16, gpus_per_node=4), seq_len=2048, global_batch=64):
        assert cfg.tp <= 4


def test_the_clock_is_the_stated_arithmetic():
    c, cluster = get_config("8b"), Cluster(16, mfu=0.5)
    cfg = TrainConfig(model="8b", dp=4, tp=2, pp=2, sp=True, seq_len=4096, global_batch=64, micro_batch=1,
                      dtype="bfloat16")
    t = step_time(c, cfg, cluster)
    tokens = 64 * 4096
    flops = 6 * (c.num_params() - 128256 * 4096) + 12 * 32 * 4096 * 4096  # the input embedding is a lookup
    assert t["compute"] == pytest.approx(tokens * flops / (16 * 989e12 * 0.5))
    m = 64 // 4  # micro-batches per rank
    turns = t["compute"] + t["tp"] + t["cp"] + t["pp"]  # what the stages wait out: each micro-batch's turn
    assert t["bubble"] == pytest.approx((2 - 1) / m * turns)  # the bubble ratio, (p-1)/m
    sent = bytes_sent(c, cfg)  # pp rank 0: 16 layers and the embedding, m micro-batches
    stream, product = 4096 * 4096 * 4, 4096 * 4096 * 2  # a layer's input (fp32) and output (bf16) in bytes
    # Per layer: 2 all-gathers of a normed input, 2 of an output's gradient; plus the embedding's.
    # Each rank sends half of every message at tp 2.
    assert sent["tp/all_gather"] == sent["tp/reduce_scatter"] == m * (2 * 16 * (stream + product) + stream) // 2
    assert t["tp"] == pytest.approx(sum(v for k, v in sent.items() if k.startswith("tp/")) / 450e9)
    # pp: pp rank 1's (here the last stage: each micro-batch's gradient back, m of a layer's input in fp32
    # over tp's 2 ranks under sp) across nodes: the two stages are 8 ranks apart
    assert t["pp"] == pytest.approx(m * stream / 2 / 50e9)
    assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"))


def test_a_calibrated_clock_adds_each_messages_latency_at_its_groups_measured_bandwidth():
    # plan.py --calibrate's cluster: groups of 2 measured at 1 ms and 1 GB/s, of 4 at 2 ms and 0.5 GB/s
    c, links = get_config("small"), ((2, 1e-3, 1e9), (4, 2e-3, 0.5e9))
    cfg = TrainConfig(model="small", dp=2, tp=2, seq_len=128, global_batch=16, micro_batch=2)
    here = Cluster(4, 4, flops=50e9, mfu=1.0, links=links)
    t, calls, sent = step_time(c, cfg, here), messages(c, cfg), bytes_sent(c, cfg)
    assert calls["tp"] == 4 * (4 * 4 + 1 + 1 + 3) + 1  # 4 micro-batches: a block's message each way, the loss's 3
    assert t["tp"] == pytest.approx(calls["tp"] * 1e-3 + sum(v for k, v in sent.items() if k.startswith("tp/")) / 1e9)
    dp = calls["dp"] * 1e-3 + sum(v for k, v in sent.items() if k.startswith("dp/")) / 1e9
    # one bucket (a small model's gradients are under 25 MB): none of it hides, it is posted once backward is done
    assert calls["dp"] == 2 and t["dp"] == pytest.approx(dp)  # train_step's count of targets, one bucket
    four = TrainConfig(model="small", dp=4, seq_len=128, global_batch=16, micro_batch=2)
    dp = step_time(c, four, here)["dp"]  # a group of 4 costs what groups of 4 measured
    assert dp == pytest.approx(messages(c, four)["dp"] * 2e-3 + bytes_sent(c, four)["dp/all_reduce"] / 0.5e9)
    assert step_time(c, four, replace(here, links=links[1:]))["dp"] == dp
    # many buckets: what backward's last 2/3 of the compute covers hides, never the last bucket
    many = replace(four, bucket_mb=0.5)
    t, buckets = step_time(c, many, replace(here, flops=50e6)), messages(c, many)["dp"] - 1  # less the count
    all_of_it = step_time(c, many, replace(here, flops=1e15))["dp"]  # compute next to nothing: all of dp shows
    assert buckets > 5 and t["dp"] == pytest.approx(all_of_it / buckets, rel=1e-3)


def test_plan_py_calibrate_refuses_a_layout_it_cannot_read_or_too_few_steps_in_one_line_before_measuring(capsys):
    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "tools" / "plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for flags, says in ((["--calibrate-layouts", "--dp 2;--zero 3"], "'--zero 3' is not a layout"),
                        (["--calibrate-layouts", "--tp 3"], "--tp 3"),
                        (["--calibrate-steps", "5"], "--calibrate-steps 5: give more than 5")):
        with pytest.raises(SystemExit) as stop:
            script.main(["--calibrate", *flags])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err  # before anything is measured


def test_train_py_plan_predicts_the_exposed_communication_in_the_words_of_the_training_log():
    cfg = TrainConfig(model="8b", dp=4, tp=2, pp=2, sp=True, seq_len=4096, global_batch=64, micro_batch=1,
                      dtype="bfloat16")
    t = step_time(get_config("8b"), cfg, Cluster(16))  # H100s, 8 to a node: the planner's defaults
    expected = exposed_line({"dp": t["dp"], "tp": t["tp"], "pp": t["pp"] + t["bubble"]}, t["total"])
    assert report(cfg).splitlines()[-1] == f"predicted on 16 H100s (the planner's clock, MFU 45%): {expected}"
    assert expected.startswith("comm exposed ") and ": dp " in expected and ", pp " in expected  # no cp: cp is 1


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1", 1), ("zbv", 1)])
def test_the_planners_bubble_is_the_schedules_own_simulated_idle_fraction(schedule, v):
    c, cluster, p, m = get_config("8b"), Cluster(16), 4, 8
    cfg = TrainConfig(model="8b", dp=2, tp=2, pp=p, sp=True, seq_len=4096, global_batch=2 * m, micro_batch=1,
                      dtype="bfloat16", schedule=schedule, virtual_stages=v)
    t = step_time(c, cfg, cluster)
    idle = simulate(build(schedule, p, m, v)).idle_fraction()
    # idle is the share of the whole step; beside the compute the wait is idle / (1 - idle), the bubble
    # ratio: (p - 1) / m for 1F1B (Narayanan et al.), not the idle fraction (which undercounts it)
    turns = t["compute"] + t["tp"] + t["cp"] + t["pp"]  # a micro-batch's turn on a stage: its work and messages
    assert t["bubble"] == pytest.approx(idle / (1 - idle) * turns, rel=1e-12)
    if schedule in ("gpipe", "1f1b"):
        assert t["bubble"] == pytest.approx((p - 1) / m * turns, rel=1e-12)
    # The simulation is the published figure where there is one, so the planner no longer gives
    # every schedule 1F1B's bubble: interleaved's is about 1/v of it, ZB-H1's about 1/3, ZB-V's less.
    published = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
                 "interleaved": (p - 1) / (v * m + p - 1), "zb1": (p - 1) / (3 * m + p - 1)}
    if schedule in published:
        assert idle == pytest.approx(published[schedule], abs=1e-12)
    else:
        assert 0 < idle < published["zb1"]


def test_plan_py_prints_the_choice_and_why_the_usual_alternatives_lose(capsys):
    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "tools" / "plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--model", "8b", "--gpus", "8", "--gpu-memory", "80GB", "--seq-len", "8192", "--global-batch", "512"])
    out = capsys.readouterr().out
    assert "The choice: --dp 8 --zero 3 --recompute-selective" in out and "plain data parallelism:" in out
    assert "recompute of whole layers:" in out
    assert "selective recompute (the cheap ops):" in out and "interleaved pipeline stages:" in out
    assert "recompute of the MLPs (the most expensive part): best is --dp 8 --zero 3 --recompute-mlp" in out
    assert " + pp " in out and "72.0 GB of it usable: 10% headroom" in out


def test_interleaved_stages_are_weighed_and_picked_where_the_bubble_costs_more_than_the_extra_messages():
    # 8B on 8 GPUs of 24 GB, 32 sequences of 4,096: it fits only cut into tp 2 x pp 4 with recompute,
    # and 8 micro-batches leave 1F1B idle 3/11 of the step. v stages a rank cut the bubble about v-fold
    # and send each micro-batch's activations v times; the search stops at the first v that does not pay.
    fits, _ = plan("8b", Cluster(8, memory=24e9), seq_len=4096, global_batch=32)
    best = fits[0]
    assert best.flags() == "--tp 2 --pp 4 --sp --recompute --schedule interleaved --virtual-stages 4", best.flags()
    by_v = {ch.cfg.virtual_stages: ch for ch in fits if replace(ch.cfg, schedule="1f1b", virtual_stages=1)
            == replace(best.cfg, schedule="1f1b", virtual_stages=1)}
    assert sorted(by_v) == [1, 2, 4]  # v = 8 (one layer a stage) was slower or too big
    assert by_v[1].time["bubble"] > by_v[2].time["bubble"] > by_v[4].time["bubble"]
    assert by_v[1].time["pp"] < by_v[2].time["pp"] < by_v[4].time["pp"]
    for ch in fits:  # every layout it offers is one train.py accepts
        ch.cfg.validate(8)
        assert ch.cfg.schedule == ("interleaved" if ch.cfg.virtual_stages > 1 else "1f1b")


def test_a_layout_that_fits_the_whole_memory_but_not_nine_tenths_is_refused_unless_the_headroom_is_0(capsys):
    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "tools" / "plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    case = ["--model", "8b", "--gpus", "8", "--gpu-memory", "24GB", "--seq-len", "4096", "--global-batch", "32"]
    kept, _ = plan("8b", Cluster(8, memory=24e9), seq_len=4096, global_batch=32)  # 10% kept free: the default
    every, _ = plan("8b", Cluster(8, memory=24e9, headroom=0), seq_len=4096, global_batch=32)
    between = [ch for ch in every if ch.memory > 0.9 * 24e9]
    assert between and all(ch.memory <= 0.9 * 24e9 for ch in kept)
    assert {ch.flags() for ch in kept} < {ch.flags() for ch in every}
    script.main(case)
    assert f"{len(kept)} layouts fit" in capsys.readouterr().out
    script.main([*case, "--headroom", "0"])
    assert f"{len(every)} layouts fit" in capsys.readouterr().out
    # train.py's pre-flight check keeps the same headroom, and says so
    with pytest.raises(ValueError, match=r"more than the limit \(22.4 GiB\) less 10% headroom \(20.1 GiB\)"):
        check_memory(between[0].cfg, limit=int(24e9))
    check_memory(between[0].cfg, limit=int(24e9), headroom=0)
    with pytest.raises(SystemExit):
        script.main([*case, "--headroom", "1"])  # a share below 1: one line, exit code 2
    assert "--headroom: 1 is out of range" in capsys.readouterr().err


@pytest.mark.integration
def test_plan_py_calibrate_measures_predicts_runs_and_tables_a_layout_leaving_nothing_behind(tmp_path):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, str(ROOT / "scripts" / "tools" / "plan.py"), "--calibrate", "--calibrate-layouts", "--dp 2",
           "--calibrate-steps", "7"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("  2 ranks: the small model's step ") and "groups of 2: α " in line for line in lines)
    row = next(line for line in lines if line.startswith("  --dp 2"))
    predicted, measured, ratio = (float(x) for x in calibration_figures(row))
    assert predicted > 0 and measured > 0 and abs(ratio - predicted / measured) < 0.02  # ms and ratio rounded
    assert lines[0].startswith("calibrating the planner's clock: this machine measured, then 1 layout(s)")
    assert re.match(r"verdict: [01] of 1 layouts predicted within 25% of their measured step", lines[-2]), lines[-2]
    assert lines[-1].startswith("verdict: the predicted order of the layouts, fastest to slowest, is ")
    assert list(tmp_path.iterdir()) == []  # its runs and logs went into a temporary folder, removed


def calibration_figures(row: str) -> tuple[str, ...]:
    """A calibration row's predicted and measured milliseconds and their ratio."""
    import re

    return re.search(r"predicted +(\d+) ms.*measured +(\d+) ms.*: ([0-9.]+)x$", row).groups()


def test_plan_prints_what_a_selective_layer_keeps_and_what_its_replay_rebuilds():
    from minipar.planning.estimate import layer_activation_bytes

    cfg = TrainConfig(model="small", recompute_selective=True)
    c, mib = cfg.model_config(), 2**20
    plain = layer_activation_bytes(c, replace(cfg, recompute_selective=False))
    assert (f"--recompute-selective: a layer keeps {layer_activation_bytes(c, cfg) / mib:,.1f} MiB (without: "
            f"{plain / mib:,.1f}); its replay rebuilds {replayed_bytes(c, cfg) / mib:,.1f} MiB") in report(cfg)
    assert replayed_bytes(c, cfg) > plain - layer_activation_bytes(c, cfg) > 0


def test_one_recompute_setting_at_a_time_and_selective_recompute_refuses_experts():
    with pytest.raises(ValueError, match="each chooses what backward redoes"):
        TrainConfig(model="small", recompute=True, recompute_selective=True).validate(1)
    with pytest.raises(ValueError, match="built for dense layers"):
        TrainConfig(model="tiny-moe", recompute_selective=True).validate(1)
    TrainConfig(model="small", recompute_selective=True).validate(1)


def test_plan_vs_published_costs_torchtitans_redone_matmuls_in_flops_per_tokens_terms():
    # scripts/tools/plan_vs_published.py adds to the clock's step, for torchtitan's 8B, the matmuls its
    # per-operator checkpointing redoes: every second of a block's (k, o, up), 2 FLOPs a weight and token,
    # forward's share of flops_per_token's 6. Its list of a block's matmuls must be the blocks' weights
    # that flops_per_token counts: all parameters but the embeddings, the head and the norms.
    spec = importlib.util.spec_from_file_location("plan_vs_published", ROOT / "scripts/tools/plan_vs_published.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for model in ("tiny", "small", "8b", "70b", "405b"):
        c = get_config(model)
        blocks = c.n_layers * sum(weights for _, weights in tool.block_matmuls(c))
        norms, head = (2 * c.n_layers + 1) * c.dim, c.vocab_size * c.dim
        assert blocks + norms + head == c.num_params() - head  # the input embedding: not tied in these
        assert c.flops_per_token(8192) == 6 * (blocks + norms + head) + 12 * c.n_layers * c.dim * 8192
        d, kv = c.dim, c.n_kv_heads * c.head_dim
        assert tool.redone_matmul_flops(c) == 2 * c.n_layers * (d * kv + d * d + d * c.ffn_dim)
    run = next(r for r in tool.RUNS if r.name == "torchtitan 8B, FSDP 8")
    c, cluster, tokens = get_config("8b"), Cluster(run.gpus), run.cfg.global_batch * run.cfg.seq_len
    step = step_time(c, run.cfg, cluster)["total"]
    extra = tokens * tool.redone_matmul_flops(c) / (cluster.gpus * cluster.flops * cluster.mfu)  # at the clock's MFU
    line = tool.redone_line(run, c, cluster, step)
    assert f"+ {extra:.2f} seconds" in line
    assert line.endswith(f"predicted / published {tokens / (step + extra) / run.gpus / run.published:.2f}")
