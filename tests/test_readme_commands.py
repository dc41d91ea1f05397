"""Every train.py command the README shows is accepted by the checks that run before training, and its
sample.py and eval.py commands run as written."""

import re
from pathlib import Path

import pytest

from minipar.run.config import parse_args

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
COMMANDS = re.findall(r"--nproc-per-node (\d+) scripts/train\.py ([^#\n]*?)\s*#", README)


def test_the_readme_shows_train_commands():
    assert len(COMMANDS) >= 5


@pytest.mark.parametrize("nproc,args", COMMANDS, ids=[a.strip() for _, a in COMMANDS])
def test_readme_train_command_passes_the_checks(nproc, args, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", nproc)
    parse_args(args.split())  # raises ConfigError (one line) on a layout that cannot run


# The commands that read a trained checkpoint (sample.py, eval.py), run as written from a folder
# that holds a tiny checkpoint under the README's runs/run_001 and this README (the text eval reads).
READERS = re.findall(r"^\.venv/bin/python scripts/(sample|eval)\.py (runs/run_001 [^#\n]*?)\s*(?:#.*)?$", README, re.M)


def test_the_readme_shows_sample_and_eval_on_the_first_run():
    assert sorted(name for name, _ in READERS) == ["eval", "sample"]


@pytest.mark.parametrize("name,args", READERS, ids=[n for n, _ in READERS])
def test_readme_sample_and_eval_commands_run_as_written(name, args, tmp_path, monkeypatch, capsys):
    import shlex
    import shutil

    from test_bad_inputs_scripts import SCRIPTS, inputs

    (tmp_path / "made").mkdir()
    made = inputs(tmp_path / "made")
    (tmp_path / "cwd" / "runs").mkdir(parents=True)
    shutil.copytree(made / "run", tmp_path / "cwd" / "runs" / "run_001")  # a tiny checkpoint with its tokenizer
    shutil.copy(Path(__file__).resolve().parents[1] / "README.md", tmp_path / "cwd" / "README.md")
    monkeypatch.chdir(tmp_path / "cwd")
    SCRIPTS[name].main(shlex.split(args))
    assert capsys.readouterr().err == ""
