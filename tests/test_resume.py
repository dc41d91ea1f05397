"""Self-resume and the safety of --out, end to end through torchrun: a worker this test kills
mid-run is restarted by `torchrun --max-restarts` with `--resume auto`, and the run ends exactly
as an uninterrupted one; later checkpoints are never overwritten; a live run's --out is refused;
and workers die with their launcher."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from test_train import ROOT, TORCHRUN, _worker_of, common, losses, one_line_error, refused, run

from minipar.run import checkpoint

# Restarts, kills and timeouts of whole torchrun jobs: minutes, in make test-integration.
pytestmark = pytest.mark.integration
TRAIN = str(ROOT / "scripts" / "train.py")
ARGS = dict(dp=2, steps=12, save_every=3, timeout=60)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run, and the same run under `torchrun --max-restarts` whose rank 1 this
    test kills (SIGKILL, from outside) the moment the first checkpoint appears in --out: rank 1 is
    then still in that save (waiting for rank 0 to finish writing) or just past it."""
    tmp = tmp_path_factory.mktemp("resume")
    run(common(tmp, **ARGS, out=tmp / "whole", log_json=tmp / "whole.jsonl"), nproc=2)
    # torchrun shares its rendezvous store with the workers and keeps it across restarts, so a
    # restarted rank can read the dead attempt's addresses (pytorch#135712): opt out, as the README says.
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    argv = common(tmp, **ARGS, out=tmp / "auto", log_json=tmp / "auto.jsonl", resume="auto")
    with open(tmp / "auto.out", "w+") as out, open(tmp / "auto.err", "w+") as err:  # files: no pipe fills up
        proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=3", TRAIN, *argv],
                                cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        try:
            kill_rank_1_when_it_appears(proc, tmp / "auto" / "step_000003")
            proc.wait(timeout=300)
        finally:
            proc.kill()
            proc.wait()
        out.seek(0)
        err.seek(0)
        return tmp, subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def kill_rank_1_when_it_appears(proc: subprocess.Popen, folder: Path) -> None:
    """SIGKILL torchrun's worker of rank 1 as soon as `folder` exists (a checkpoint is renamed into
    place only when whole)."""
    t0 = time.monotonic()
    while not folder.exists():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before {folder.name} appeared"
        assert time.monotonic() - t0 < 300, f"no {folder.name} after 300 s"
        time.sleep(0.005)
    os.kill(_worker_of(proc.pid, 1), signal.SIGKILL)


def test_a_killed_worker_is_restarted_and_the_run_ends_exactly_as_an_uninterrupted_one(runs):
    tmp, killed = runs
    assert killed.returncode == 0, killed.stderr[-3000:]
    # One restart, from the newest whole checkpoint when rank 1 died (step 3, or a later one had
    # the run gone on before the kill landed); the first attempt started fresh (--out was empty).
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", killed.stdout)
    assert len(resumed) == 1, killed.stdout[-3000:]
    # The survivor says in one line which rank it lost (if torchrun has not ended it first), never a traceback.
    assert "[rank0]: Traceback" not in killed.stderr and "[rank0]:   File" not in killed.stderr, killed.stderr[-3000:]
    said = [line for line in killed.stderr.splitlines() if line.startswith("minipar: error: rank 0: a peer closed")]
    assert all("ranks [1] did not say" in line for line in said), said
    # The dead rank is named in one line (torchrun's, when it ended the survivor first), before the restart.
    named = [i for i, line in enumerate(killed.stderr.splitlines()) if "exitcode: -9) local_rank: 1" in line
             or "ranks [1] did not say" in line]
    assert named, killed.stderr[-3000:]
    start = int(resumed[0][1])
    assert resumed[0][0] == str(tmp / "auto" / f"step_{start:06d}") and start % ARGS["save_every"] == 0
    records = [json.loads(line) for line in (tmp / "auto.jsonl").read_text().splitlines()]
    assert {r.pop("run_id") for r in records} == {(tmp / "auto" / "run_id").read_text()}  # both attempts': one run
    # One record a step: the restart dropped the steps it ran again, and marked where it resumed.
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13)), records
    assert [r for r in records if "loss" not in r] == [{"step": start, "resumed": True}]
    assert records.index({"step": start, "resumed": True}) == start
    assert losses(tmp / "auto.jsonl") == losses(tmp / "whole.jsonl")  # bitwise: the restart's steps too
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (tmp / "auto" / "step_000012" / name).read_bytes() == (tmp / "whole" / "step_000012" / name).read_bytes()
    assert [p.name for p in checkpoint.checkpoints(tmp / "auto")] == [f"step_{s:06d}" for s in (3, 6, 9, 12)]
    assert not (tmp / "auto" / ".lock").exists()  # given back at the end


def test_resuming_into_an_out_with_later_checkpoints_or_a_live_lock_is_refused(runs, monkeypatch, capsys):
    tmp, _ = runs
    auto = tmp / "auto"
    # The first two in this process (cli.main, as test_train's refusals); the live lock through the
    # program, so that the lock's pid is another process's (this one's), as a live run's would be.
    line = refused(common(tmp, **dict(ARGS, dp=1), resume=auto / "step_000006"), monkeypatch, capsys)
    assert f"--out {auto} already holds checkpoints after {auto / 'step_000006'} (step_000009 ... step_000012)" \
        in line and f"--resume {auto}, or choose another --out" in line
    for ckpt in checkpoint.checkpoints(auto):  # kept, whole
        checkpoint.verify(ckpt)
    line = refused(common(tmp, **dict(ARGS, dp=1), resume="auto"), monkeypatch, capsys)
    assert "--resume auto needs --out" in line
    lock = tmp / "whole" / ".lock"
    lock.write_text(f"{socket.gethostname()} {os.getpid()}")  # this test's own process: alive
    try:
        line = one_line_error(run(common(tmp, **dict(ARGS, dp=1), resume="auto", out=tmp / "whole"), check=False))
    finally:
        lock.unlink()
    assert f"is in use by another run (host {socket.gethostname()}, pid {os.getpid()})" in line


def test_a_corrupt_newest_checkpoint_is_set_aside_and_restarts_resume_from_the_one_before(runs):
    # --out holds the uninterrupted run's step 3 and step 6, one byte of step 6's weights flipped.
    # Under torchrun --max-restarts with --resume auto, the first attempt moves step 6 aside by name
    # and continues from step 3; rank 1 is then killed (SIGKILL) the moment step 9 appears, in that
    # save, and the restart continues from step 9. Every logged loss, and the last checkpoint, are
    # bitwise the uninterrupted run's: the run from the checkpoint it fell back to.
    tmp, _ = runs
    out = tmp / "fallback"
    for step in (3, 6):
        shutil.copytree(tmp / "whole" / f"step_{step:06d}", out / f"step_{step:06d}")
    weights = out / "step_000006" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x10
    weights.write_bytes(bytes(data))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    argv = common(tmp, **ARGS, out=out, log_json=tmp / "fallback.jsonl", resume="auto")
    with open(tmp / "fallback.out", "w+") as said, open(tmp / "fallback.err", "w+") as err:
        proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=2", TRAIN, *argv],
                                cwd=ROOT, env=env, stdout=said, stderr=err, text=True)
        try:
            kill_rank_1_when_it_appears(proc, out / "step_000009")
            proc.wait(timeout=300)
        finally:
            proc.kill()
            proc.wait()
        said.seek(0)
        err.seek(0)
        stdout, stderr = said.read(), err.read()
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.splitlines().count(f"minipar: checkpoint {out / 'step_000006'} is corrupt: model.safetensors does "
                                     f"not match its checksum: moved it aside to step_000006.corrupt, resuming "
                                     f"from an earlier one") == 1, stdout[-3000:]
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", stdout)
    assert resumed[0] == (str(out / "step_000003"), "3") and len(resumed) == 2, resumed  # one restart, after the kill
    again = int(resumed[1][1])
    assert resumed[1][0] == str(out / f"step_{again:06d}") and again >= 9 and again % ARGS["save_every"] == 0
    whole = losses(tmp / "whole.jsonl")
    records = [json.loads(line) for line in (tmp / "fallback.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert all(loss == whole[step] for step, loss in logged), logged  # bitwise, both attempts' every step
    assert [s for s, _ in logged] == list(range(4, 13)), logged  # one a step: the restart dropped what it ran again
    assert [r["step"] for r in records if r.get("resumed")] == [3, again]
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (out / "step_000012" / name).read_bytes() == (tmp / "whole" / "step_000012" / name).read_bytes()
    assert [p.name for p in checkpoint.checkpoints(out)] == [f"step_{s:06d}" for s in (3, 6, 9, 12)]
    assert (out / "step_000006.corrupt" / "model.safetensors").read_bytes() == bytes(data)  # kept as it was


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def test_workers_exit_when_torchrun_is_killed(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    argv = common(tmp_path, dp=2, steps=10_000, log_every=1, out=tmp_path / "orphan")
    proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", TRAIN, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    workers = []
    try:
        for line in proc.stdout:  # training has started once the first step is logged
            if line.startswith("step "):
                break
        workers = [_worker_of(proc.pid, rank) for rank in (0, 1)]
        proc.send_signal(signal.SIGKILL)  # torchrun gets no chance to stop them itself
        proc.wait()
        t0 = time.monotonic()
        while any(map(_alive, workers)) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), workers
    finally:
        for pid in filter(_alive, workers):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
