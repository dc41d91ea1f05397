"""--profile-steps A:B: each rank writes a trace that loads as Chrome-trace JSON, in which every
message the ledger counted during the profiled steps is a range named for it (kind, group/op,
payload bytes), each posted message paired with the range of its wait; scripts/tools/trace_report.py
reads the folder into shares of the step; a restart of --resume auto profiles nothing twice (the
flag's refusals: test_config.py and test_bad_inputs.py). The ranges come from the clock
(comm_clock.py), the steps' from extras/profiling.py."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest
import torch
from harness import run_ranks
from test_train import common, run

from minipar.comm_clock import KINDS, WaitClock
from minipar.data_parallel import param_groups
from minipar.extras.profiling import StepProfiler
from minipar.mesh import Mesh
from minipar.model import get_config
from minipar.ops.cli import check_profiled_steps
from minipar.ops.command_line import parse_args
from minipar.parallelize import adamw, build_grad_sync
from minipar.run.config import ConfigError, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
RANGE = re.compile(r"minipar (\w+): (.+?)(?:, (posted|wait) #(\d+))?")  # kind: messages[, posted|wait #k]
MESSAGE = re.compile(r"(\w+)/(\w+) (\d+) B")  # one message of a range: group/op payload


def trace_report():
    spec = importlib.util.spec_from_file_location("trace_report", ROOT / "scripts" / "tools" / "trace_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def messages_in(trace: dict, step: int) -> tuple[dict, dict]:
    """The message ranges inside the range of step `step`: ({"group/op": [calls, payload bytes]},
    {"posted" and "wait": the numbers that pair a posted message with its handles' waits})."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    [span] = [e for e in events if e["name"] == f"ProfilerStep#{step}"]
    counted: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    paired: dict[str, set[int]] = {"posted": set(), "wait": set()}
    for e in events:
        name = RANGE.fullmatch(e["name"])
        if name is None or not span["ts"] <= e["ts"] <= span["ts"] + span["dur"]:
            continue
        kind, messages, how, number = name.groups()
        if how:
            paired[how].add(int(number))
        if how == "wait":  # the same message, waited for: not another one
            continue
        for group, op, nbytes in MESSAGE.findall(messages):
            assert kind == KINDS.get(group, group)
            counted[f"{group}/{op}"][0] += 1
            counted[f"{group}/{op}"][1] += int(nbytes)
    return dict(counted), paired


def expected(ledger: dict, sizes: dict) -> dict:
    """The ledger's calls and payload of each group/op whose group has other ranks to talk to."""
    return {key: [e["calls"], e["bytes"]] for key, e in ledger.items() if sizes[key.split("/")[0]] > 1}


def _profiled_steps(rank, world, layout, out):
    """Two steps of the tiny model under `layout`, both profiled: the ledger of each, and the groups' sizes."""
    import minipar.run.train as train
    from minipar.run.step import micro_batches_of

    cfg = TrainConfig(model="tiny", seq_len=16, global_batch=8, micro_batch=2, dtype="float64", out=str(out),
                      wandb=False, steps=2, profile_steps="1:2", **layout)
    mesh = Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp)
    mesh.ledger.clock = WaitClock()
    profiler = StepProfiler(cfg, mesh.ledger.clock, mesh.ledger, torch.device("cpu"))
    model, pipeline = train.build_model(cfg, mesh, get_config("tiny"), torch.device("cpu"), torch.float64)
    wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr),
                              zero=cfg.zero, bucket_mb=0.01)  # several buckets: several posted all-reduces
    x = torch.randint(0, 256, (cfg.global_batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    rows = x.chunk(cfg.dp)[mesh.coord("dp")]
    micro = micro_batches_of((rows[:, :-1], rows[:, 1:]), mesh, cfg.micro_batch, torch.device("cpu"))
    ledgers = []
    for step in range(cfg.steps):
        mesh.ledger.reset()
        profiler.begin(step)
        train.train_step(wrapper, micro, cfg.grad_clip, nullcontext, pipeline)
        profiler.end(step)
        ledgers.append(mesh.ledger.snapshot())
    groups = [mesh.group(d) for d in ("dp", "tp", "pp", "cp")] + [mesh.groups().dp_cp, mesh.group("pp", channel="grad")]
    left = (mesh.ledger.listeners, mesh.ledger.clock.noted)  # profiling over: no listener, no names
    mesh.destroy()
    return ledgers, {g.name: g.size for g in groups}, left


@pytest.mark.parametrize("layout", [
    dict(tp=2, cp=2, sp=True, tp_overlap=True),  # blocking, posted (the overlap's), batched (the cp ring's)
    pytest.param(dict(dp=2, pp=2, zero=1), marks=pytest.mark.integration)], ids=["tp2-cp2-sp-overlap", "dp2-pp2"])
def test_every_message_of_the_profiled_steps_is_a_range_of_the_trace(layout, tmp_path):
    results = run_ranks(4, _profiled_steps, layout, tmp_path, timeout=300)
    folder = tmp_path / "traces" / "steps_1-2"
    assert sorted(p.name for p in folder.iterdir()) == [f"rank{r}.pt.trace.json" for r in range(4)]
    for rank, (ledgers, sizes, left) in enumerate(results):
        assert left == ([], None)
        trace = json.loads((folder / f"rank{rank}.pt.trace.json").read_text())
        for step, ledger in enumerate(ledgers, start=1):
            counted, paired = messages_in(trace, step)
            assert counted == expected(ledger, sizes) and counted, (rank, step)
            assert paired["posted"] == paired["wait"] and paired["posted"], (rank, step)  # each post, waited
    assert {"communication", "compute", "idle"} <= trace_report().main([str(folder)])[0]["shares"].keys()


@pytest.mark.integration
def test_train_py_profile_steps_writes_a_trace_per_rank_that_the_report_reads(tmp_path, capsys):
    out = tmp_path / "out"
    run(common(tmp_path, dp=2, steps=3, out=out, log_json=tmp_path / "log.jsonl") + ["--profile-steps=2:3"], nproc=2)
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines())}
    folder = out / "traces" / "steps_2-3"
    assert sorted(f.name for f in folder.iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]  # no part left
    for rank in (0, 1):  # dp: the ranks send alike, so rank 0's ledger in the log is each rank's
        trace = json.loads((folder / f"rank{rank}.pt.trace.json").read_text())
        assert trace["traceEvents"]
        for step in (2, 3):
            assert messages_in(trace, step)[0] == expected(records[step]["comm"], {"dp": 2}), (rank, step)
    report = trace_report().main([str(folder)])
    assert sorted(report) == [0, 1]
    for figures in report.values():
        assert all(0 <= share <= 1 for share in [*figures["shares"].values(), figures["overlap"]])
        assert sum(figures["shares"].values()) == pytest.approx(1)
    assert "steps 2 to 3" in capsys.readouterr().out


def test_a_restart_drops_steps_it_resumes_past_and_traces_written_already(tmp_path):
    cfg = parse_args(["--steps=9", f"--out={tmp_path}", "--profile-steps=3:4", "--resume=auto"])
    assert check_profiled_steps(cfg, 0) is None and cfg.profile_steps == "3:4"  # the first attempt profiles
    assert "resumes after step 5" in check_profiled_steps(cfg, 5) and cfg.profile_steps is None
    (tmp_path / "traces" / "steps_3-4").mkdir(parents=True)
    cfg = parse_args(["--steps=9", f"--out={tmp_path}", "--profile-steps=3:4", "--resume=auto"])
    assert "steps_3-4 exists" in check_profiled_steps(cfg, 2) and cfg.profile_steps is None


def test_a_traces_path_that_is_no_folder_is_dropped_on_a_restart_as_traces_written_already(tmp_path):
    (tmp_path / "traces").write_text("a file of the user's")  # without --resume auto: refused (test_bad_inputs.py)
    cfg = parse_args(["--steps=9", f"--out={tmp_path}", "--profile-steps=3:4", "--resume=auto"])
    assert "traces is not a folder" in check_profiled_steps(cfg, 0) and cfg.profile_steps is None
    assert (tmp_path / "traces").read_text() == "a file of the user's"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_traces_folder_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    (tmp_path / "traces").mkdir(mode=0o500)
    cfg = parse_args(["--steps=9", f"--out={tmp_path}", "--profile-steps=3:4"])
    with pytest.raises(ConfigError, match="--profile-steps 3:4: cannot write in .*traces: make it writable"):
        check_profiled_steps(cfg, 0)


def test_a_run_stopped_mid_trace_exits_with_its_own_code_and_writes_no_trace(tmp_path):
    """Ctrl-C (exit 130) or a failure between steps A and B: the profiler, still running, is stopped at
    exit (left running, torch's exit crashes: a segfault, 139) and nothing is written."""
    stopped = f"""
from minipar.collectives import Ledger
from minipar.comm_clock import WaitClock
from minipar.run.config import TrainConfig
from minipar.extras.profiling import StepProfiler
import torch
profiler = StepProfiler(TrainConfig(steps=3, profile_steps="2:3", out={str(tmp_path)!r}), WaitClock(), Ledger(),
                        torch.device("cpu"))
profiler.begin(1)
torch.ones(4).sum()
raise SystemExit(130)
"""
    done = subprocess.run([sys.executable, "-c", stopped], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-2000:]
    assert not (tmp_path / "traces").exists()


def test_the_report_warns_when_the_folder_lacks_some_of_the_runs_ranks(tmp_path, capsys):
    # An older run under plain torchrun without --out left rank 1's trace in a folder of its own: a report
    # of rank 0 alone must not read like one of the whole run.
    def trace(rank):
        return json.dumps({"distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2}, "traceEvents": [
            {"ph": "X", "name": "ProfilerStep#2", "ts": 0, "dur": 10, "tid": 1},
            {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 1, "dur": 5, "tid": 1}]})
    (tmp_path / "rank0.pt.trace.json").write_text(trace(0))
    assert sorted(trace_report().main([str(tmp_path)])) == [0]
    assert capsys.readouterr().err.splitlines() == [
        f"trace_report.py: warning: the run had 2 ranks and {tmp_path} holds the traces of 1: rank 1 missing; the "
        f"figures below are only those of the ranks here"]
    (tmp_path / "rank1.pt.trace.json").write_text(trace(1))
    assert sorted(trace_report().main([str(tmp_path)])) == [0, 1]
    assert capsys.readouterr().err == ""
