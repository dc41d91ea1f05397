"""Every train.py command the README shows is accepted by the checks that run before training, and its
sample.py and eval.py commands run as written."""

import re
from pathlib import Path

import pytest

from minipar.ops.command_line import parse_args

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
READERS = re.findall(r"^\.venv/bin/python scripts/tools/(sample|eval)\.py (runs/run_001 [^#\n]*?)\s*(?:#.*)?$",
                     README, re.M)


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


def test_the_readmes_config_file_exists_and_its_command_passes_the_checks(monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    command = re.search(r"^\.venv/bin/python scripts/train\.py (--config \S+ [^#\n]*?)\s*#", README, re.M)
    assert command, "the README shows a --config command"
    parse_args(command[1].split())  # the file is shipped, and its settings pass the checks


def test_the_readmes_fault_tolerance_command_fits_its_layout(monkeypatch):
    # torchrun's options on one line, train.py's flags on the next (after a backslash)
    command = re.search(r"--nproc-per-node (\d+) --standalone \\\n\s+scripts/train\.py (.*)", README)
    assert command, "the README shows the replica groups' torchrun command"
    monkeypatch.setenv("WORLD_SIZE", command[1])
    cfg = parse_args(command[2].replace("--replica-group-id g", "--replica-group-id 1").split())
    assert cfg.replica_groups == 2 and cfg.tp == 8


def test_make_train_runs_through_minipars_launcher_and_passes_args():
    # Ctrl-C under a bare torchrun ends in its agent's traceback; the launcher keeps the run's one line
    # (tests/test_interrupt.py runs `make train` and interrupts it).
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = re.search(r"^train: .*\n\t(.*)$", makefile, re.M)[1]
    assert "scripts/train.py --standalone --nproc-per-node 2" in recipe and "torchrun" not in recipe
    assert recipe.endswith("$(ARGS)") and "MINIPAR_MAKE_ARGS='$(ARGS)'" in recipe
