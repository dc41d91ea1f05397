"""`python scripts/train.py --nproc-per-node N ... --max-restarts R`: the launcher checks torchrun's
options with the run's, once, and refuses restarts under a rendezvous whose store outlives an
attempt (torchrun's static one: a fixed --master-port, an --rdzv-endpoint without a backend, or
several nodes without one) in one line, exit 2, before torchrun's agent or any worker starts.
Plain `torchrun --max-restarts` with --master-port is refused by each worker in the same words.

The table runs cli.main in this process, torchrun's `run` replaced by one that records what it
was given; one case runs as the program, and one under the real torchrun."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from test_bad_inputs import base
from test_train import ROOT, TORCHRUN

from minipar.ops import cli, hang

STATIC = "with torchrun's static rendezvous (--master-port): drop --master-port and use --standalone"
BAD = [  # (torchrun's options and the run's flags, a fragment of the one line)
    (["--nproc-per-node=2", "--max-restarts=1", "--master-port=29500", "--dp=2"], f"--max-restarts 1 {STATIC}"),
    (["--nproc-per-node", "2", "--max-restarts", "3", "--master_port", "29500", "--dp=2"],
     f"--max-restarts 3 {STATIC}"),
    (["--nproc-per-node=2", "--max-restarts=1", "--rdzv-endpoint=127.0.0.1:29400", "--dp=2"], STATIC),
    (["--nproc-per-node=1", "--nnodes=2", "--max-restarts=1", "--master-addr=10.0.0.1", "--dp=2"], STATIC),
    (["--nproc-per-node=2", "--max-restarts=-1", "--dp=2"], "--max-restarts '-1': give a whole number, at least 0"),
    (["--nproc-per-node=2", "--max-restarts=three", "--dp=2"], "--max-restarts 'three': give a whole number"),
    (["--nproc-per-node=2", "--max-restarts", "--dp=2"], "--max-restarts '--dp=2': give a whole number"),
    (["--nproc-per-node=2", "--nnodes=1:2", "--max-restarts=1", "--dp=2"], "--nnodes '1:2': give a whole number, "
     "at least 1 (this launcher takes no ranges"),
    (["--max-restarts=3", "--dp=2"], "--max-restarts is torchrun's option: give --nproc-per-node N with it"),
    (["--nproc-per-node=2", "--max-restarts=3", "--standalone", "--tp=3"], "--tp 3 does not divide"),  # once
    (["--nproc-per-node=2", "--max-restarts=3", "--standalone", "--dp=2", "--resume=auto", "--out="],
     "--out is empty"),
]


def launcher_main(t: Path, argv: list[str], monkeypatch) -> tuple[int, list]:
    """cli.main(base + argv) as the user's command (no RANK); torchrun's agent recorded, not run."""
    monkeypatch.chdir(t)
    for name in ("RANK", "WORLD_SIZE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.setenv(name, "")  # then removed: monkeypatch puts back what was there
        monkeypatch.delenv(name)
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(
        (args, os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"))))
    return cli.main(base(t) + argv), started


@pytest.mark.parametrize("argv, fragment", BAD, ids=[" ".join(row[0]) for row in BAD])
def test_the_launcher_refuses_restarts_it_cannot_keep_in_one_line_before_any_worker(tmp_path, argv, fragment,
                                                                                  monkeypatch, capsys):
    code, started = launcher_main(tmp_path, argv, monkeypatch)
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and started == [], (code, started)
    assert len(lines) == 1 and lines[0].startswith("minipar: error: ") and fragment in lines[0], lines
    assert "WORLD_SIZE" not in os.environ  # set for the check, and taken back


@pytest.mark.parametrize("argv", [
    ["--nproc-per-node=2", "--max-restarts=3", "--standalone"],
    ["--nproc-per-node=2", "--max-restarts=3"],  # one node, no port: torchrun makes it c10d on a free port
    ["--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400"],
    ["--nproc-per-node=2", "--master-port=29500"],  # static, no restarts: nothing to keep across attempts
], ids=" ".join)
def test_the_launcher_starts_torchruns_agent_for_rendezvous_that_restart_cleanly(tmp_path, argv, monkeypatch,
                                                                               capsys):
    code, started = launcher_main(tmp_path, [*argv, "--dp=2"], monkeypatch)
    assert code == 0 and len(started) == 1, capsys.readouterr().err
    args, fresh_store = started[0]
    restarts = "--max-restarts=3" in argv
    assert args.max_restarts == (3 if restarts else 0) and args.nproc_per_node == "2"
    assert fresh_store == ("1" if restarts else None)  # each attempt a new store: set for the user
    assert args.training_script_args == [*base(tmp_path), "--dp=2"]  # the run's flags, to each worker


def test_the_launcher_as_a_program_refuses_a_static_rendezvous_with_restarts_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--nproc-per-node", "2",
                           "--max-restarts", "2", "--master-port", "29500", *base(tmp_path), "--dp=2"], cwd=tmp_path,
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert lines[0].startswith(f"minipar: error: --max-restarts 2 {STATIC}"), lines[0]


@pytest.mark.integration
def test_plain_torchrun_with_a_static_rendezvous_and_restarts_is_refused_by_each_worker(tmp_path):
    # What the workers are told is real here (check_rendezvous reads torchrun's variables): under a
    # fixed --master-port the store is the agent's, whatever TORCH_DISABLE_SHARE_RDZV_TCP_STORE says.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run([TORCHRUN, "--nproc-per-node=1", "--max-restarts=1", f"--master-port={port}",
                           str(ROOT / "scripts" / "train.py"), *base(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("minipar: error: ")]
    assert proc.returncode != 0 and len(ours) == 2, proc.stderr[-3000:]  # the first attempt and its one restart
    assert all(line.startswith("minipar: error: torchrun --max-restarts 1 with its static rendezvous (--master-port)")
               for line in ours), ours
    assert not (tmp_path / "out").exists()  # no worker got as far as --out


def test_joining_without_a_timeout_waits_as_torch_does():
    """The benchmarks join with timeout=None: no watchdog, and no line to format (it once raised a
    TypeError formatting None before the group started)."""
    started = []
    hang.join(lambda: started.append(True), None)
    assert started == [True]
