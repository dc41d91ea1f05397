"""Nothing a user owns is overwritten or mixed into: every script that writes a folder or file
refuses a target that holds anything, in one line with exit 2, and leaves it byte-identical.

The writers: convert.py import and export, draw_figures.py, plot_precision.py, train_ft.py, step_06_pipeline.py
(all through minipar/ops/args.new_folder: built beside the target, renamed into place) and
train.py's --out (a run's own folder: only a run's checkpoints, lock and logs may be in it). The
targets: a file, a folder holding a file, a checkpoint, a run's --out, a Hugging Face model, and
the script's own source (the data-loss case: `convert.py export OUT OUT/step_000004` once
overwrote the checkpoint it read)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_inputs_scripts import SCRIPTS, inputs, one_line
from test_train import common, refused

from minipar.ops import run_folder
from minipar.run import checkpoint

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WRITERS = {**SCRIPTS, "draw_figures": script("draw_figures"), "plot_precision": script("plot_precision")}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """test_bad_inputs_scripts' inputs: a checkpoint with its tokenizer, a Hugging Face folder..."""
    return inputs(tmp_path_factory.mktemp("owned"))


def occupy(kind: str, target: Path, t: Path) -> None:
    """Put at `target` what a user may own there."""
    if kind == "a file":
        target.write_text("my notes\n")
    elif kind == "a folder holding a file":
        target.mkdir()
        (target / "notes.txt").write_text("my notes\n")
    elif kind == "a checkpoint":
        shutil.copytree(t / "run" / "step_000002", target)
    elif kind == "a run's --out":
        shutil.copytree(t / "run", target)
    elif kind == "a Hugging Face model":
        shutil.copytree(t / "hf", target)


KINDS = ["a file", "a folder holding a file", "a checkpoint", "a run's --out", "a Hugging Face model"]


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every path under `folder` (itself included) and its bytes (a link: where it points)."""
    found = {}
    for path in [folder, *sorted(folder.rglob("*"))] if folder.is_dir() else [folder]:
        rel = str(path.relative_to(folder.parent))
        found[rel] = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return found


def refuses(name: str, argv: list, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        WRITERS[name].main([str(a) for a in argv])
    assert e.value.code == 2
    return one_line(capsys.readouterr().err)


def argv_of(name: str, target: Path, t: Path) -> list:
    return {"convert import": ["import", t / "hf", target], "convert export": ["export", t / "run", target],
            "draw_figures": ["zero", "--out", target], "plot_precision": ["--steps", "1", "--out", target],
            "train_ft": ["--steps", "30", "--out", target]}[name]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("writer", ["convert import", "convert export", "draw_figures", "plot_precision", "train_ft"])
def test_a_script_refuses_a_target_that_holds_anything_and_leaves_it_byte_identical(made, tmp_path, writer, kind,
                                                                                      capsys):
    target = tmp_path / "target"
    occupy(kind, target, made)
    before, beside = snapshot(target), sorted(os.listdir(tmp_path))
    line = refuses(writer.split()[0], argv_of(writer, target, made), capsys)
    assert str(target) in line and ("new or empty folder" in line or "give a new file" in line), line
    assert snapshot(target) == before and sorted(os.listdir(tmp_path)) == beside  # no temporary folder left


@pytest.mark.parametrize("argv, fragment", [
    (["export", "{t}/run", "{t}/run/step_000002"], "is inside {t}/run"),  # the checkpoint it reads: the data loss
    (["export", "{t}/run", "{t}/run"], "holds files"),
    (["export", "{t}/run", "{t}/run/hf"], "is inside {t}/run, which it is made from"),  # a new folder in the run
    (["export", "{t}/run/step_000002", "{t}/run/step_000002/hf"], "is inside"),
    (["import", "{t}/hf", "{t}/hf"], "holds files"),
    (["import", "{t}/hf", "{t}/hf/minipar"], "is inside {t}/hf, which it is made from"),
])
def test_convert_never_writes_into_its_own_source(made, argv, fragment, capsys):
    source = Path(argv[1].format(t=made))
    before = snapshot(source)
    line = refuses("convert", [a.format(t=made) for a in argv], capsys)
    assert fragment.format(t=made) in line, line
    assert snapshot(source) == before
    checkpoint.verify(made / "run" / "step_000002")  # still whole


def test_a_target_under_a_file_is_one_line_not_an_errno(made, capsys):
    line = refuses("convert", ["import", made / "hf", made / "tok.json" / "out"], capsys)
    assert "cannot create a folder beside it" in line and "give a folder path you can write" in line, line


def test_an_empty_folder_is_filled_and_an_export_carries_the_checkpoints_tokenizer(made, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert WRITERS["convert"].main(["export", str(made / "run"), str(tmp_path / "empty")]) == tmp_path / "empty"
    assert sorted(os.listdir(tmp_path / "empty")) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (tmp_path / "empty" / "tokenizer.json").read_bytes() == (made / "tok.json").read_bytes()
    done = WRITERS["convert"].main(["import", str(tmp_path / "empty"), str(tmp_path / "new" / "run")])
    assert done == tmp_path / "new" / "run" / "step_000000" and checkpoint.verify(done)["step"] == 0
    assert sorted(os.listdir(tmp_path)) == ["empty", "new"]  # the temporary folders are gone
    assert json.loads((tmp_path / "empty" / "config.json").read_text())["vocab_size"] > 0


@pytest.mark.parametrize("kind", ["a folder holding a file", "a checkpoint", "a Hugging Face model"])
def test_train_refuses_an_out_holding_what_no_run_writes(made, tmp_path, kind, monkeypatch, capsys):
    target = tmp_path / "target"
    occupy(kind, target, made)
    before = snapshot(target)
    line = refused(common(tmp_path, out=target, steps=2), monkeypatch, capsys)
    assert f"--out {target} holds files that are not a minipar run's" in line and "new or empty folder" in line, line
    assert snapshot(target) == before


def test_train_refuses_an_out_holding_another_runs_checkpoints(made, tmp_path, monkeypatch, capsys):
    target = tmp_path / "target"
    occupy("a run's --out", target, made)
    before = snapshot(target)
    line = refused(common(tmp_path, out=target, steps=4), monkeypatch, capsys)
    assert f"--out {target} already holds checkpoints of an earlier run" in line, line
    assert snapshot(target) == before


def test_a_runs_own_files_and_its_json_log_do_not_make_its_out_foreign(tmp_path):
    out = tmp_path / "out"
    for name in ("step_000004", "step_000008.corrupt", "step_000008.corrupt-2", ".tmp-minipar-12-step_000012",
                 "wandb", "traces", ".tmp-x", ".tmp-12-step_000012"):
        (out / name).mkdir(parents=True)
    for name in (".lock", "run_id", "wandb_run_id", "log.jsonl"):
        (out / name).write_text("")
    # train.py lets log.jsonl through only as this run's --log-json; a .tmp-* not of minipar's form is the user's
    assert run_folder.not_a_runs(out) == [".tmp-12-step_000012", ".tmp-x", "log.jsonl"]
    assert run_folder.not_a_runs(tmp_path / "missing") == []


def test_step_06_refuses_an_out_holding_an_earlier_runs_pngs(tmp_path):
    """The program itself (torchrun, one rank): the check runs on every rank before any drawing."""
    target = tmp_path / "step_06"
    target.mkdir()
    (target / "1f1b_measured.png").write_bytes(b"an earlier run's picture")
    before = snapshot(target)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(ROOT / "scripts" / "course" / "step_06_pipeline.py"), "--out", str(target)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode != 0 and f"--out {target} holds files" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    assert "Traceback" not in proc.stdout and snapshot(target) == before


def test_a_new_run_never_appends_its_json_log_to_an_existing_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "log.jsonl").write_text("my notes\n")
    line = refused(common(tmp_path, out=tmp_path / "out", log_json=tmp_path / "log.jsonl"), monkeypatch, capsys)
    assert f"--log-json {tmp_path / 'log.jsonl'} exists: a new run never appends" in line, line
    assert (tmp_path / "log.jsonl").read_text() == "my notes\n" and not (tmp_path / "out").exists()
