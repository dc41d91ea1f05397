"""scripts/train.py end to end: the loss falls, runs repeat exactly, checkpoints resume exactly,
and bad input is refused with one line."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from harness import tiers
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")  # ~100 KB of real text


def common(tmp, **over):
    args = dict(model="tiny", data=CORPUS, vocab_size=512, cache_dir=str(tmp / "cache"), seq_len=32,
                global_batch=8, micro_batch=4, lr=1e-2, warmup=4, dtype="float64", log_every=5)
    args.update(over)
    return [f"--{k.replace('_', '-')}={v}" for k, v in args.items()] + ["--no-wandb"]


def run(argv, nproc=None, check=True, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})}
    cmd = ([TORCHRUN, "--standalone", f"--nproc-per-node={nproc}"] if nproc else [sys.executable])
    proc = subprocess.run(cmd + [str(ROOT / "scripts" / "train.py"), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    run(common(tmp, dp=2, steps=20, save_every=10, out=tmp / "a", log_json=tmp / "a.jsonl"), nproc=2)
    return tmp


def test_dp2_run_lowers_the_loss(run_a):
    a = losses(run_a / "a.jsonl")
    assert sorted(a) == list(range(1, 21))
    first, last = sum(a[s] for s in range(1, 6)) / 5, sum(a[s] for s in range(16, 21)) / 5
    assert last < first - 0.5, (first, last)
    rec = json.loads((run_a / "a.jsonl").read_text().splitlines()[-1])
    assert rec["bytes_sent"] > 0 and rec["comm"]["dp/all_reduce"]["calls"] >= 1
    assert len(rec["peak_memory"]) == 2 and all(m > 0 for m in rec["peak_memory"])


@pytest.mark.integration
def test_same_seed_gives_the_same_losses(run_a):
    tmp = run_a
    run(common(tmp, dp=2, steps=20, out=tmp / "b", log_json=tmp / "b.jsonl"), nproc=2)
    assert losses(tmp / "b.jsonl") == losses(tmp / "a.jsonl")


@pytest.mark.integration
def test_resumed_run_continues_exactly_where_it_stopped(run_a):
    tmp = run_a
    ckpt = tmp / "a" / "step_000010"
    assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "optimizer.safetensors",
                                                     "tokenizer.json", "train_state.json"]
    run(common(tmp, dp=2, steps=20, resume=ckpt, out=tmp / "c", log_json=tmp / "c.jsonl"), nproc=2)
    a, c = losses(tmp / "a.jsonl"), losses(tmp / "c.jsonl")
    assert sorted(c) == list(range(11, 21))
    for step in c:
        assert c[step] == pytest.approx(a[step], rel=1e-12), step


def one_line_error(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("minipar: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


class Started(Exception):
    """The checks passed: the run would start its process group now."""


def refused(argv, monkeypatch, capsys) -> str:
    """cli.main(argv) in this process, as `python scripts/train.py argv` runs it (one rank, from the
    repository): it must return 2 with one line. A subprocess would prove the same at seconds of torch
    import each; test_world_size_... below runs the program itself, so exit 2 and no traceback are proven
    end to end once. cli.launch_watched (the process group, the training) fails the test if a check lets it through."""
    from minipar.ops import cli

    monkeypatch.chdir(ROOT)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    def started(cfg, resume, interrupt, extras=()):
        raise Started

    monkeypatch.setattr(cli, "launch_watched", started)
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("minipar: error: "), (code, err)
    assert "Traceback" not in out + err
    return lines[0]


def test_world_size_that_does_not_match_the_degrees_is_one_line(tmp_path):
    line = one_line_error(run(common(tmp_path, dp=2), check=False))  # the program itself: exit 2, one line
    assert "= 2 ranks, but the world has 1: launch with torchrun --nproc-per-node 2" in line


def test_missing_data_path_is_one_line(tmp_path, monkeypatch, capsys):
    line = refused(common(tmp_path, data=tmp_path / "nope.txt"), monkeypatch, capsys)
    assert "no such file or directory" in line


def test_layouts_the_model_or_sequence_cannot_take_are_one_line(tmp_path, monkeypatch, capsys):
    def line(**kw):
        return refused(common(tmp_path, **kw), monkeypatch, capsys)

    assert "not divisible by 2 x --cp = 4" in line(cp=2, seq_len=30)
    assert "does not divide the model's 4 attention heads" in line(tp=3)
    assert "pipeline stages" in line(pp=4)  # tiny has 2 layers


def test_indivisible_batch_is_one_line(tmp_path, monkeypatch, capsys):
    line = refused(common(tmp_path, global_batch=6, micro_batch=4), monkeypatch, capsys)
    assert "--global-batch 6 is not divisible" in line


def test_corrupt_checkpoint_is_one_line_and_earlier_checkpoints_are_kept(run_a, tmp_path, monkeypatch, capsys):
    import shutil

    bad = tmp_path / "bad" / "step_000010"
    shutil.copytree(run_a / "a" / "step_000010", bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    line = refused(common(tmp_path, resume=bad), monkeypatch, capsys)
    assert "is corrupt" in line
    # An --out that already holds checkpoints is never overwritten by a fresh run.
    kept = {p: p.read_bytes() for p in sorted((run_a / "a").rglob("*")) if p.is_file()}
    line = refused(common(tmp_path, out=run_a / "a"), monkeypatch, capsys)
    assert "already holds checkpoints" in line
    assert {p: p.read_bytes() for p in sorted((run_a / "a").rglob("*")) if p.is_file()} == kept


@pytest.mark.integration
def test_torchrun_layout_error_prints_our_line_once_before_any_work(tmp_path):
    proc = run(common(tmp_path, dp=4, micro_batch=2), nproc=2, check=False)
    assert proc.returncode != 0, proc.stderr
    ours = [l for l in proc.stderr.splitlines() if l.startswith("minipar: error:")]
    assert len(ours) == 1 and "= 4 ranks, but the world has 2" in ours[0], proc.stderr
    assert "scripts/train.py\", line" not in proc.stderr, proc.stderr  # no traceback from our workers


@pytest.mark.integration
def test_dp2_tp2_sp_run_gives_the_losses_of_the_dp2_run(run_a):
    tmp = run_a
    run(common(tmp, dp=2, tp=2, steps=20, out=tmp / "tp", log_json=tmp / "tp.jsonl") + ["--sp"], nproc=4)
    a, t = losses(tmp / "a.jsonl"), losses(tmp / "tp.jsonl")
    for step in a:
        assert t[step] == pytest.approx(a[step], rel=1e-10), step
    rec = json.loads((tmp / "tp.jsonl").read_text().splitlines()[-1])
    assert rec["comm"]["tp/all_gather"]["calls"] > 0 and rec["comm"]["tp/reduce_scatter"]["calls"] > 0


@pytest.mark.integration
def test_dp2_pp2_resumes_a_dp2_checkpoint_and_continues_its_losses(run_a):
    # A checkpoint holds single-device tensors, so a dp=2 checkpoint resumes at dp2 x pp2; the
    # pipeline (1F1B over 2 micro-batches) then gives the dp=2 run's losses, and its own final
    # checkpoint, gathered from both stages, is whole again.

    tmp = run_a
    run(common(tmp, dp=2, pp=2, micro_batch=2, steps=20, resume=tmp / "a" / "step_000010", out=tmp / "pp",
               log_json=tmp / "pp.jsonl"), nproc=4)
    a, p = losses(tmp / "a.jsonl"), losses(tmp / "pp.jsonl")
    assert sorted(p) == list(range(11, 21))
    for step in p:
        assert p[step] == pytest.approx(a[step], rel=1e-10), step
    rec = json.loads((tmp / "pp.jsonl").read_text().splitlines()[-1])
    assert 0.0 <= rec["bubble"] < 1.0 and rec["comm"]["pp/send"]["calls"] > 0
    whole = load_file(tmp / "pp" / "step_000020" / "model.safetensors")
    assert whole.keys() == load_file(tmp / "a" / "step_000020" / "model.safetensors").keys()


@pytest.mark.integration
def test_headline_dp2_tp2_pp2_on_8_ranks_matches_one_process_in_float32(tmp_path):
    # The README's headline layout, through train.py itself, in float32: the same losses as one
    # process on the same global batch, to float32 rounding.
    args = dict(dtype="float32", steps=8, micro_batch=2)
    run(common(tmp_path, **args, out=tmp_path / "one", log_json=tmp_path / "one.jsonl"))
    run(common(tmp_path, **args, dp=2, tp=2, pp=2, out=tmp_path / "3d", log_json=tmp_path / "3d.jsonl"), nproc=8)
    one, three_d = losses(tmp_path / "one.jsonl"), losses(tmp_path / "3d.jsonl")
    assert sorted(three_d) == list(range(1, 9))
    # The 8 ranks sum in other orders (dp all-reduce, tp-split products, pp stages): a loss over logits ~600
    # roundings deep differs by about eps 1.2e-7 x sqrt(900) = 4e-6 of itself, and AdamW's steps (lr x m/sqrt(v))
    # hardly feel a gradient's rounding (seen over 8 steps: 8e-8). Relative 1e-5; absolute 0 (losses ~6).
    for step in one:
        assert three_d[step] == pytest.approx(one[step], rel=1e-5, abs=0), step


@pytest.mark.integration
@pytest.mark.parametrize("zero,extra", [(2, ["--recompute"]), (3, []), (3, ["--recompute"])])
def test_zero_resumes_a_dp2_checkpoint_and_continues_its_losses(run_a, zero, extra):
    tmp = run_a
    name = f"z{zero}{''.join(extra)}"
    run(common(tmp, dp=2, zero=zero, steps=20, resume=tmp / "a" / "step_000010", out=tmp / name,
               log_json=tmp / f"{name}.jsonl") + extra, nproc=2)
    a, z = losses(tmp / "a.jsonl"), losses(tmp / f"{name}.jsonl")
    for step in z:
        assert z[step] == pytest.approx(a[step], rel=1e-10), step
    held = json.loads((tmp / f"{name}.jsonl").read_text().splitlines()[-1])["held_bytes"]
    plain = json.loads((tmp / "a.jsonl").read_text().splitlines()[-1])["held_bytes"]
    assert held["optimizer"] <= plain["optimizer"] // 2 + 1024  # Adam's moments: half per rank at dp=2
    if zero == 3:  # between steps only the master slices: half the weights
        assert held["params"] <= plain["params"] // 2 + 1024
    # Its own final checkpoint holds the whole model and optimizer, as an unsharded run's does.

    mine = load_file(tmp / name / "step_000020" / "optimizer.safetensors")
    theirs = load_file(tmp / "a" / "step_000020" / "optimizer.safetensors")
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert mine[key].shape == theirs[key].shape


@pytest.mark.integration
def test_dp2_cp2_resumes_a_dp2_checkpoint_and_continues_its_losses(run_a):
    tmp = run_a
    run(common(tmp, dp=2, cp=2, steps=20, resume=tmp / "a" / "step_000010", out=tmp / "cp",
               log_json=tmp / "cp.jsonl"), nproc=4)
    a, c = losses(tmp / "a.jsonl"), losses(tmp / "cp.jsonl")
    for step in c:
        assert c[step] == pytest.approx(a[step], rel=1e-10), step
    rec = json.loads((tmp / "cp.jsonl").read_text().splitlines()[-1])
    assert rec["comm"]["cp/send"]["calls"] > 0 and "dp_cp/all_reduce" in rec["comm"]


def test_a_diverging_run_skips_bad_steps_then_stops_and_saves_nothing_non_finite(tmp_path):
    # lr 1e30: the first update sends the weights to ~1e30 and the next gradient norms are NaN.
    out = tmp_path / "nan"
    proc = run(common(tmp_path, dtype="float32", lr=1e30, warmup=1, steps=20, save_every=1, out=out,
                      log_json=tmp_path / "nan.jsonl", max_bad_steps=3), check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "minipar: error: the run diverged: 3 steps in a row" in proc.stderr
    assert proc.stdout.count("step skipped, weights unchanged") == 3
    saved = sorted(out.glob("step_*"))
    assert saved and len(saved) < 20  # it stopped early
    for ckpt in saved:
        for name in ("model.safetensors", "optimizer.safetensors"):
            for key, t in load_file(ckpt / name).items():
                assert torch.isfinite(t).all(), (ckpt.name, name, key)


def _worker_of(parent: int, rank: int) -> int:
    """The pid of torchrun's worker with RANK=rank (read from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if f"RANK={rank}".encode() in (stat.parent / "environ").read_bytes().split(b"\0"):
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    raise AssertionError(f"no worker with RANK={rank} under {parent}")


@pytest.mark.integration
def test_a_stopped_rank_becomes_a_named_error_within_the_timeout(tmp_path):
    import signal
    import time

    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    argv = common(tmp_path, dp=2, steps=10_000, log_every=1, out=tmp_path / "hang", timeout=10)
    proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", str(ROOT / "scripts" / "train.py"),
                             *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        for line in proc.stdout:  # training has started once the first step is logged
            if line.startswith("step "):
                break
        stopped = _worker_of(proc.pid, 1)
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        err = ""
        while "minipar: error" not in err and time.monotonic() - t0 < 60:
            err += proc.stderr.readline()
        elapsed = time.monotonic() - t0
    finally:
        if stopped:
            os.kill(stopped, signal.SIGKILL)
        proc.kill()
        proc.wait()
    line = next(x for x in err.splitlines() if "minipar: error" in x)
    assert "rank 0: no answer within --timeout 10 s" in line and "dp/" in line, line
    assert elapsed < 10 + 10, elapsed


def _one_rank_skips_an_all_reduce(rank, world, skip):
    """Both ranks all-reduce once on dp; then rank 0 asks dp for a second one that rank 1 skips:
    it waits on tp instead (skip="tp"), or does nothing (skip="stop"). Returns each rank's report."""
    import datetime
    import time

    import torch.distributed as dist

    from minipar.collectives import Group, Ledger, all_reduce
    from minipar.ops.hang import HangWatch, hang_report

    dist.barrier()  # both here (importing this file takes each rank its own time), then the 5 s limit
    ledger, limit = Ledger(), datetime.timedelta(seconds=5)
    watch = HangWatch()
    watch.listen(ledger)
    dp = Group("dp", dist.new_group([0, 1], timeout=limit), [0, 1], ledger)
    tp = Group("tp", dist.new_group([0, 1], timeout=limit), [0, 1], ledger)
    all_reduce(torch.ones(1), dp)
    if rank == 1 and skip == "stop":
        time.sleep(10)  # silent past rank 0's timeout and its wait for the others' counts
        return None
    try:
        all_reduce(torch.ones(1), dp if rank == 0 else tp)
    except RuntimeError as e:
        return hang_report(5, watch, e)
    return "no timeout"


@pytest.mark.parametrize("skip", tiers(["tp", "stop"], fast=0))
def test_the_hang_report_names_the_rank_that_never_reached_the_collective(skip):
    import harness

    first, second = harness.run_ranks(2, _one_rank_skips_an_all_reduce, skip, timeout=240)
    harness._pools.pop((2, "gloo")).close(kill=True)  # its groups timed out, its store holds the counts: not reused
    assert first.startswith("rank 0: no answer within --timeout 5 s; the last operation it asked of others was "
                            "dp/all_reduce #2 with ranks [0, 1]: "), first
    if skip == "tp":  # each names the other: rank 1 is behind on dp, rank 0 never came to tp
        assert "ranks [1] never reached it (at #1)" in first, first
        assert "tp/all_reduce #1 with ranks [0, 1]: ranks [0] never reached it (at #0)" in second, second
    else:
        assert "ranks [1] did not say (stopped, died, or waiting on another group)" in first, first
