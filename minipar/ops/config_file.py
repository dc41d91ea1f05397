"""A run's settings in a TOML file (`train.py --config run.toml`), read with Python's own tomllib.

    # run.toml: the keys are train.py's flags without their dashes
    model = "tiny"
    dim = 64                 # a model-shape flag: overrides the preset's
    global-batch = 16        # or global_batch
    wandb = false            # a switch: true or false (--wandb / --no-wandb)

The file's values become the command line's defaults, so a flag given on the command line wins.
Each value is checked against its flag before anything runs: a key that is no flag, or a value of
the wrong type or outside the flag's choices, is refused with one line naming the key; the ranges
are then checked with the command line's own rules (config.py). The same conversions apply as on
the command line (`lr = 1` is 1.0), so a file reproduces the run of the equivalent flags exactly.

config.as_toml writes settings back in the same syntax: the effective config every run prints.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from typing import Any

from minipar.run.paths import regular_if_present

KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """{flag's dest: value} from the TOML file at `path`, each checked against the parser's flag.
    Raises ValueError (one line) naming the file and the key."""
    try:
        with open(regular_if_present(path, f"--config {path}"), "rb") as f:  # a FIFO would block: refused first
            table = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path} is not UTF-8 (byte {e.start} is {e.object[e.start]:#04x}): TOML files are "
                         f"UTF-8; save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path} is not TOML: {e}") from None
    flags = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    values = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest not in flags:
            raise ValueError(f"--config {path}: unknown key '{key}' (the keys are train.py's flags without their "
                             f"dashes, e.g. global-batch; train.py --help lists them)")
        values[dest] = flag_value(flags[dest], value, f"--config {path}: {key}")
    return values


def flag_value(flag: argparse.Action, value, where: str):
    """`value` as the flag would have parsed it, or ValueError naming `where`."""
    kind: Any = bool if flag.nargs == 0 else flag.type or str  # nargs 0: a switch (--sp / --no-sp)
    fits = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, fits = float(value), True  # TOML's 1 is the command line's 1.0
    if not fits:
        raise ValueError(f"{where} = {json.dumps(value, default=str)} should be {KINDS[kind]}")
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(f"{where} = {json.dumps(value)} is not one of {', '.join(map(str, flag.choices))}")
    return value
