"""Ctrl-C is a normal way to stop a run: every rank stops after the same step, the run saves there
and says in one line where it stopped and what to resume from, and the resumed run continues with
the losses of the uninterrupted one. A repeat of the signal within a second (the terminal's and
torchrun's copies of one Ctrl-C) is ignored; a later one, or one before the steps, stops at once."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress

import pytest
from test_train import ROOT, TORCHRUN, _worker_of, common, losses, run

from minipar.ops import cli
from minipar.ops import interrupt as interrupt_
from minipar.run.run_log import RunLog

# The stop's line: the step every rank stopped after, and the command (ending in --resume CKPT) that continues.
STOPPED = re.compile(r"minipar: interrupted: stopped after step (\d+) of \d+, on every rank; "
                     r"continue with: .+ --resume ([^\s']+)'?$")  # make train's ARGS='...' ends in a quote


def at_once(monkeypatch):
    """os._exit as SystemExit, so that a stop at once can be watched from inside this process."""
    def leave(code):
        raise SystemExit(code)
    monkeypatch.setattr(os, "_exit", leave)


def signal_self(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in this (the main) thread, at the latest when the sleep is interrupted


def test_a_ctrl_c_in_the_steps_waits_for_the_step_end_and_a_repeat_within_a_second_is_the_same_one():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupt_.Interrupt() as interrupt:
        interrupt.stepping = True
        signal_self(signal.SIGINT)
        first = interrupt.at
        assert first is not None  # heard; the run goes on to the end of its step
        signal_self(signal.SIGINT)  # the terminal's copy of the same Ctrl-C
        signal_self(signal.SIGTERM)  # torchrun's, after it forwarded SIGINT
        assert interrupt.at == first
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # put back


def test_a_sigterm_that_follows_no_ctrl_c_goes_to_the_handler_before_as_torchruns_end_of_a_run():
    heard = []
    before = signal.signal(signal.SIGTERM, lambda sig, frame: heard.append(sig))  # stands in for the default
    try:
        with interrupt_.Interrupt() as interrupt:
            interrupt.stepping = True
            signal_self(signal.SIGTERM)
            assert heard == [signal.SIGTERM] and interrupt.at is None
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("when", ["before the steps", "a second Ctrl-C, later", "rank 1, later"])
def test_a_later_ctrl_c_or_one_before_the_steps_stops_at_once_with_one_line_from_rank_0(
        when, tmp_path, monkeypatch, capsys):
    at_once(monkeypatch)
    monkeypatch.setenv("RANK", "1" if when.startswith("rank 1") else "0")
    out = tmp_path / "out"
    (out / "step_000004").mkdir(parents=True)
    (out / ".lock").write_text(f"{socket.gethostname()} {os.getpid()}")  # rank 0's, which it gives back
    with interrupt_.Interrupt() as interrupt:
        interrupt.out = str(out)
        if when != "before the steps":
            interrupt.stepping = True
            signal_self(signal.SIGINT)
            interrupt.at -= 1.5  # as if the first came 1.5 s ago
        with pytest.raises(SystemExit) as stopped:
            signal_self(signal.SIGINT)
    assert stopped.value.code == 130
    err = capsys.readouterr().err.splitlines()
    if when.startswith("rank 1"):
        assert err == [] and (out / ".lock").exists()  # rank 0 says it, for every rank
        return
    again = " again" if when != "before the steps" else ""
    assert len(err) == 1 and err[0].startswith(f"minipar: interrupted{again}: stopped at once; continue with: ")
    assert err[0].endswith(f" --resume {out / 'step_000004'}")  # the command that started it (rerun_command)
    assert not (out / ".lock").exists()


def interrupt_at_tick(n, monkeypatch):
    """A SIGINT to this process as step n begins (RunLog.tick), as Ctrl-C would send it."""
    ticks = []

    def tick(self, step):
        ticks.append(1)
        if len(ticks) == n:
            os.kill(os.getpid(), signal.SIGINT)
        self.t0 = time.perf_counter()
    monkeypatch.setattr(RunLog, "tick", tick)


def one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def test_a_ctrl_c_at_step_3_saves_step_3_says_so_in_one_line_and_the_resumed_run_continues_its_losses(
        tmp_path, monkeypatch, capsys):
    one_process(monkeypatch)
    argv = common(tmp_path, steps=6, save_every=100)
    before = signal.getsignal(signal.SIGINT)
    assert cli.main(argv + [f"--out={tmp_path / 'a'}", f"--log-json={tmp_path / 'a.jsonl'}"]) == 0
    interrupt_at_tick(3, monkeypatch)
    capsys.readouterr()
    assert cli.main(argv + [f"--out={tmp_path / 'b'}", f"--log-json={tmp_path / 'b.jsonl'}"]) == 130
    assert signal.getsignal(signal.SIGINT) is before
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "interrupted" in line or line.startswith("saved")]
    ckpt = tmp_path / "b" / "step_000003"
    assert len(said) == 1 and STOPPED.match(said[0]) and STOPPED.match(said[0])[2] == str(ckpt), said
    assert sorted(p.name for p in (tmp_path / "b").glob("step_*")) == ["step_000003"]
    monkeypatch.undo()
    one_process(monkeypatch)
    resumed = [f"--resume={ckpt}", f"--out={tmp_path / 'c'}", f"--log-json={tmp_path / 'c.jsonl'}"]
    assert cli.main(argv + resumed) == 0
    a, b, c = (losses(tmp_path / f"{x}.jsonl") for x in "abc")
    assert sorted(b) == [1, 2, 3] and sorted(c) == [4, 5, 6]
    assert {**b, **c} == a  # float64, the same steps: exactly the uninterrupted run's losses


def test_with_no_save_on_interrupt_the_stop_names_the_newest_checkpoint_already_saved(tmp_path, monkeypatch, capsys):
    one_process(monkeypatch)
    interrupt_at_tick(3, monkeypatch)
    argv = common(tmp_path, steps=6, save_every=2, out=tmp_path / "b") + ["--no-save-on-interrupt"]
    assert cli.main(argv) == 130
    said = [line for line in capsys.readouterr().out.splitlines() if "interrupted" in line]
    ckpt = tmp_path / "b" / "step_000002"
    assert len(said) == 1 and STOPPED.match(said[0]) and STOPPED.match(said[0])[2] == str(ckpt), said
    assert sorted(p.name for p in (tmp_path / "b").glob("step_*")) == ["step_000002"]


def started_stepping(proc, step=3) -> list[str]:
    """stdout's lines up to the log line of `step` (log_every 1): the run is in its steps."""
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith(f"step {step:>5}/"):
            return lines
    raise AssertionError(f"the run ended before step {step}:\n" + "\n".join(lines) + proc.stderr.read()[-3000:])


def popen(cmd, argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return subprocess.Popen([*cmd, str(ROOT / "scripts" / "train.py"), *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.integration
def test_ctrl_c_on_train_py_with_two_ranks_stops_both_after_one_step_in_one_line_and_resumes_exactly(tmp_path):
    # `python scripts/train.py --nproc-per-node 2`: torchrun's agent runs in this process and passes the
    # SIGINT on to both workers, as after a Ctrl-C in the terminal.
    argv = common(tmp_path, dp=2, steps=20, log_every=1)
    proc = popen([sys.executable], argv + ["--nproc-per-node=2", f"--out={tmp_path / 'b'}",
                                           f"--log-json={tmp_path / 'b.jsonl'}"])
    try:
        lines = started_stepping(proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines += out.splitlines()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    said = [line for line in lines if "interrupted" in line or line.startswith("saved")]
    assert len(said) == 1 and STOPPED.match(said[0]), said
    step, ckpt = int(STOPPED.match(said[0])[1]), STOPPED.match(said[0])[2]
    assert 3 <= step < 20 and ckpt == str(tmp_path / "b" / f"step_{step:06d}")
    assert sorted(losses(tmp_path / "b.jsonl")) == list(range(1, step + 1))
    run(argv + [f"--resume={ckpt}", f"--out={tmp_path / 'c'}", f"--log-json={tmp_path / 'c.jsonl'}"], nproc=2)
    run(argv + [f"--out={tmp_path / 'a'}", f"--log-json={tmp_path / 'a.jsonl'}"], nproc=2)
    a, b, c = (losses(tmp_path / f"{x}.jsonl") for x in "abc")
    assert {**b, **c} == a  # float64: the interrupted and resumed run gives the uninterrupted losses


@pytest.mark.integration
def test_under_torchrun_one_ranks_ctrl_c_heard_three_times_at_once_stops_every_rank_after_one_step(tmp_path):
    # Plain torchrun; only rank 1 hears it (rank 0 learns it in the step's gather), three times within a
    # second, as a terminal's SIGINT, torchrun's and torchrun's SIGTERM would come: one stop, exit 0 (a
    # worker's clean stop: torchrun must not restart it), rank 0's one line.
    argv = common(tmp_path, dp=2, steps=20, log_every=1, out=tmp_path / "b")
    proc = popen([TORCHRUN, "--standalone", "--nproc-per-node=2"], argv)
    try:
        lines = started_stepping(proc)
        worker = _worker_of(proc.pid, 1)
        for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
            with suppress(ProcessLookupError):
                os.kill(worker, sig)
            time.sleep(0.1)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines += out.splitlines()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "stopped at once" not in err, err[-3000:]
    said = [line for line in lines if "interrupted" in line or line.startswith("saved")]
    assert len(said) == 1 and STOPPED.match(said[0]), said
    assert (tmp_path / "b" / f"step_{int(STOPPED.match(said[0])[1]):06d}").is_dir()


@pytest.mark.integration
def test_a_second_ctrl_c_a_while_later_stops_at_once_in_one_line_and_gives_out_back(tmp_path):
    # Steps of seconds (the small model, 128 sequences of 128 tokens): the second Ctrl-C, 1.2 s after the
    # first, comes while the step the first one waits for is still running. The agent, interrupted again,
    # sends the workers SIGTERM: they stop at once.
    argv = common(tmp_path, model="small", seq_len=128, global_batch=128, micro_batch=8, dp=2, steps=20,
                  log_every=1, out=tmp_path / "b")
    proc = popen([sys.executable], argv + ["--nproc-per-node=2"])
    try:
        lines = started_stepping(proc, step=1)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if any(STOPPED.match(line) for line in lines + out.splitlines()):
        pytest.skip("a step took under 1.2 s here: the first Ctrl-C's stop came before the second")
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    said = [line for line in without_progress_bar(err) if "minipar" in line]
    assert said == ["minipar: interrupted again: stopped at once; no checkpoint was saved"], err[-3000:]
    assert not (tmp_path / "b" / ".lock").exists()


@pytest.mark.parametrize("how", ["make train", "the launcher", "torchrun", "one process"])
def test_the_stop_line_gives_the_whole_command_that_continues_the_run_its_own_resume_replaced(how, monkeypatch):
    for name in ("MINIPAR_MAKE_ARGS", "MINIPAR_COMMAND", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ckpt = "runs/run_001/step_000045"
    monkeypatch.setattr(sys, "argv", ["scripts/train.py", "--dp", "2", "--resume", "runs/old", "--steps=50"])
    if how == "make train":
        monkeypatch.setenv("MINIPAR_MAKE_ARGS", "--steps 50 --resume=runs/old --lr 1e-3")
        expected = "make train ARGS='--steps 50 --lr 1e-3 --resume runs/run_001/step_000045'"
    elif how == "the launcher":  # its own argv, handed to the workers; theirs is scripts/train.py's and the run's
        monkeypatch.setenv("MINIPAR_COMMAND", '["scripts/train.py", "--nproc-per-node", "2", "--dp", "2", "--resume",'
                                              ' "runs/old", "--steps=50"]')
        expected = "--nproc-per-node 2 --dp 2 --steps=50 --resume runs/run_001/step_000045"
    elif how == "torchrun":
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        expected = "torchrun --nproc-per-node=2 scripts/train.py --dp 2 --steps=50 --resume runs/run_001/step_000045"
    else:
        expected = "scripts/train.py --dp 2 --steps=50 --resume runs/run_001/step_000045"
    command = interrupt_.rerun_command(ckpt)
    assert command.endswith(expected) and command.count("--resume") == 1, command
    if how in ("the launcher", "one process"):
        assert command.split()[0] in (sys.executable, os.path.relpath(sys.executable))  # the Python that ran it


def test_a_ctrl_c_during_the_launchers_own_checks_stops_at_once_in_one_line(tmp_path, monkeypatch, capsys):
    # train.py --nproc-per-node N checks everything before its agent starts a worker; tokenising a large
    # corpus takes minutes: a Ctrl-C then stops at once, with the one line, not a KeyboardInterrupt traceback.
    one_process(monkeypatch)
    at_once(monkeypatch)

    def interrupted(cfg):
        signal_self(signal.SIGINT)
    monkeypatch.setattr(cli, "check_memory", interrupted)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        cli.main(common(tmp_path, dp=2) + ["--nproc-per-node=2", f"--out={tmp_path / 'b'}"])
    assert stopped.value.code == 130
    assert capsys.readouterr().err.splitlines() == ["minipar: interrupted: stopped at once; no checkpoint was saved"]
    assert signal.getsignal(signal.SIGINT) is before and not (tmp_path / "b").exists()


def without_progress_bar(err: str) -> list[str]:
    """stderr's lines less tqdm's redraws (carriage returns; the bar is on stderr by design)."""
    return [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("train:")]


@pytest.mark.integration
def test_ctrl_c_during_make_train_ends_in_the_runs_one_line_and_its_command_continues_the_run(tmp_path):
    # The README's first command, as a terminal's Ctrl-C reaches it: SIGINT to the whole process group
    # (make, the launcher, its workers). Only minipar's line, then make's report of the exit status.
    args = " ".join(common(tmp_path, steps=20, log_every=1, out=tmp_path / "b")[:-1]) + " --no-wandb"
    env = dict(os.environ, WANDB_MODE="disabled")
    env.pop("MAKEFLAGS", None)
    proc = subprocess.Popen(["make", "--no-print-directory", "train", f"ARGS={args}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = started_stepping(proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    said = [line for line in lines + out.splitlines() if "interrupted" in line]
    assert len(said) == 1 and STOPPED.match(said[0]), (said, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    rest = without_progress_bar(err)  # make's report of the exit status, as make[1] under another make
    assert len(rest) <= 1 and re.fullmatch(r"make(\[\d+\])?: \*\*\* \[Makefile:24: train\] (Error 130|Interrupt)",
                                           rest[0] if rest else "make: *** [Makefile:24: train] Interrupt"), err[-3000:]
    step, ckpt = int(STOPPED.match(said[0])[1]), STOPPED.match(said[0])[2]
    command = said[0].split("continue with: ")[1]
    assert command == f"make train ARGS={shlex.quote(args + ' --resume ' + ckpt)}"
    resumed = subprocess.run(shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"saved {tmp_path / 'b' / 'step_000020'}" in resumed.stdout and step < 20
