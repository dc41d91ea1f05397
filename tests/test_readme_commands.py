"""Every train.py command the README shows is accepted by the checks that run before training."""

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
