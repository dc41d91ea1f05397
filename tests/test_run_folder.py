"""The run folder rule: minipar clears or rewrites only what it can tell it made. A user's file or
folder of any name, inside any target a run, a resume, an export or the figures script writes
(--out, --log-json, convert.py's folders, draw_figures.py's --out), or beside one, is left
byte-identical: the command either works around it or is refused in one line (exit 2) before it
changes anything. Names near the file system's limit (255 bytes) work, or are refused up front.
And every rank of a torchrun job without --out saves into the one folder rank 0 chose."""

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from test_bad_inputs_scripts import inputs
from test_no_overwrite import WRITERS, refuses, snapshot
from test_train import ROOT, TORCHRUN, common, refused

from minipar.ops import cli, run_folder
from minipar.run import checkpoint

LONG = 250  # bytes: a name that fits (the file system takes 255), with no room for a `.tmp-<pid>-` prefix
# What a user may keep in a folder minipar writes into, or beside one: (name, file text; None: a folder).
USERS = {".tmp-x": None, ".tmp-123-step_000004": None, ".tmp-minipar-9-x": None, ".tmp-minipar-1-step_4b": None,
         "notes.txt": "my notes\n", ".lock": "my tool's lock\n", "run_id": "my run\n",
         "other.jsonl": json.dumps({"run_id": "0123456789ab", "step": 1, "loss": 2.5}) + "\n"}
# --log-json files a resumed run must not take for its own: another run's, an older minipar's, not a log.
FOREIGN_LOGS = {"another run's": USERS["other.jsonl"], "no run id": '{"step": 1, "loss": 2.5}\n',
                "not JSON": "my notes\n", "empty": "", "JSON, not records": "[1, 2]\n",
                "deeply nested": "[" * 100_000 + "]" * 100_000 + "\n", "a checkpoint's train_state.json": None,
                "a FIFO": None}


def plant(folder: Path, names=USERS) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        if USERS[name] is None:
            (folder / name).mkdir()
            (folder / name / "notes.txt").write_text("mine\n")
        else:
            (folder / name).write_text(USERS[name])


def users(folder: Path) -> dict:
    """The snapshot of the user's things in `folder`."""
    return {name: snapshot(folder / name) for name in USERS}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """In a folder holding every USERS thing: a run (2 steps; its --out and --log-json named with
    LONG bytes), its resume (to step 3, the same log), an export and an import (convert.py, into
    a LONG name) and a figure (draw_figures.py). Returns the folder and its USERS as they were."""
    t = tmp_path_factory.mktemp("beside")
    plant(t)
    before = users(t)
    out, log = t / ("o" * LONG), t / ("l" * (LONG - 6) + ".jsonl")
    argv = common(t, out=out, log_json=log, save_every=2)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
            mp.delenv(name, raising=False)
        assert cli.main(argv + ["--steps=2"]) == 0
        assert cli.main(argv + ["--steps=3", f"--resume={out}"]) == 0
    hf = WRITERS["convert"].main(["export", str(out), str(t / ("h" * LONG))])
    WRITERS["convert"].main(["import", str(hf), str(t / "imported")])
    WRITERS["draw_figures"].main(["ring", "--out", str(t / "figures")])
    return t, before


def test_what_a_run_a_resume_an_export_and_a_figure_write_leaves_the_users_things_beside_them(ran):
    t, before = ran
    assert users(t) == before
    out, log = t / ("o" * LONG), t / ("l" * (LONG - 6) + ".jsonl")
    assert [p.name for p in checkpoint.checkpoints(out)] == ["step_000002", "step_000003"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["run_id"] for r in records} == {run_folder.run_id(out)}  # one run's records, rewritten by itself
    assert [(r["step"], "resumed" in r) for r in records] == [(1, False), (2, False), (2, True), (3, False)]
    assert sorted((t / ("h" * LONG)).iterdir()) and (t / "imported" / "step_000000").is_dir()
    assert sorted(p.name for p in (t / "figures").iterdir()) == ["01_ring_bytes.png"]
    made_here = {"cache", out.name, log.name, "h" * LONG, "imported", "figures"}
    assert set(os.listdir(t)) == set(USERS) | made_here  # and no temporary of its own left


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """test_bad_inputs_scripts' inputs: a checkpoint with its tokenizer, a Hugging Face folder..."""
    return inputs(tmp_path_factory.mktemp("owned"))


def copy_of_run(ran, target: Path) -> Path:
    shutil.copytree(ran[0] / ("o" * LONG), target)
    return target


@pytest.mark.parametrize("resumed", [False, True], ids=["a new run", "a resume"])
@pytest.mark.parametrize("name", USERS)
def test_a_users_thing_in_out_is_refused_in_one_line_and_left_byte_identical(ran, tmp_path, name, resumed,
                                                                             monkeypatch, capsys):
    out = copy_of_run(ran, tmp_path / "out") if resumed else tmp_path / "out"
    plant(out, [name])  # a resume's copy: the user's run_id in place of the run's
    before = snapshot(out)
    argv = common(tmp_path, out=out, steps=4) + ([f"--resume={out}"] if resumed else [])
    line = refused(argv, monkeypatch, capsys)
    assert f"--out {out}" in line and ("not a minipar run's" in line or "not minipar's" in line), line
    assert snapshot(out) == before


@pytest.mark.parametrize("kind", FOREIGN_LOGS)
def test_a_resumed_run_refuses_a_json_log_that_is_not_its_own_and_leaves_it_byte_identical(ran, tmp_path, kind,
                                                                                         monkeypatch, capsys):
    out = copy_of_run(ran, tmp_path / "out")
    log = tmp_path / "log.jsonl"
    if kind == "a FIFO":  # which would block its reader
        os.mkfifo(log)
    else:
        log.write_text(FOREIGN_LOGS[kind] or (out / "step_000003" / "train_state.json").read_text())
    before = snapshot(out), os.stat(log).st_mtime, log.is_fifo() or log.read_bytes()
    line = refused(common(tmp_path, out=out, log_json=log, steps=4, resume=out), monkeypatch, capsys)
    assert f"--log-json {log} is not" in line and ("give a new file" in line or "give a file" in line), line
    assert (snapshot(out), os.stat(log).st_mtime, log.is_fifo() or log.read_bytes()) == before


@pytest.mark.parametrize("writer", ["convert export", "convert import", "draw_figures"])
@pytest.mark.parametrize("name", USERS)
def test_a_script_refuses_a_target_holding_any_users_name_and_leaves_it_byte_identical(made, tmp_path, writer, name,
                                                                                      capsys):
    target = tmp_path / "target"
    plant(target, [name])
    before, beside = snapshot(target), sorted(os.listdir(tmp_path))
    argv = {"convert export": ["export", made / "run", target], "convert import": ["import", made / "hf", target],
            "draw_figures": ["ring", "--out", target]}[writer]
    line = refuses(writer.split()[0], argv, capsys)
    assert f"{target} holds files" in line, line
    assert snapshot(target) == before and sorted(os.listdir(tmp_path)) == beside


def test_a_name_longer_than_the_file_system_takes_is_refused_up_front(made, tmp_path, monkeypatch, capsys):
    long = "n" * 256
    for flags in (dict(out=tmp_path / long), dict(out=tmp_path / "out", log_json=tmp_path / long / "log.jsonl"),
                  dict(out=tmp_path / "out", log_json=tmp_path / (long + ".jsonl"))):
        line = refused(common(tmp_path, **flags), monkeypatch, capsys)
        assert "is 256 bytes, more than the 255 a file system takes in one name: give a shorter one" in line or \
            "is 262 bytes" in line, line
    line = refuses("convert", ["export", made / "run", tmp_path / long], capsys)
    assert "export's HF_DIR: the name nnnn" in line and "give a shorter one" in line, line
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == []  # nothing made


@pytest.mark.integration
@pytest.mark.parametrize("rendezvous", ["--standalone", "--master-port"])
def test_every_rank_of_torchrun_without_out_saves_into_the_folder_rank_0_chose(tmp_path, rendezvous):
    """Plain torchrun (the README's `--profile-steps` example), no --out: one runs/run_NNN holds
    both ranks' traces; run_001 is taken already, so the choice is not a coincidence of empty folders."""
    (tmp_path / "runs" / "run_001").mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = ["--standalone"] if rendezvous == "--standalone" else [f"--master-port={port}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([TORCHRUN, *agent, "--nproc-per-node=2", str(ROOT / "scripts" / "train.py"),
                           *common(tmp_path, dp=2, steps=2, timeout=120), "--profile-steps=2:2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run_001", "run_002"]
    traces = tmp_path / "runs" / "run_002" / "traces" / "steps_2-2"
    assert sorted(p.name for p in traces.iterdir()) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "runs" / "run_002")] == ["step_000002"]


def test_ranks_that_cannot_share_a_store_are_asked_for_out(monkeypatch):
    for name, value in dict(RANK="1", WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="False").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(cli.ConfigError, match="cannot agree on a new runs/run_NNN: give --out"):
        cli.new_run_folder(5.0)
