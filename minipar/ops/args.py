"""Command lines checked before anything runs: the argparse types and path checks every script
shares (train.py, convert.py, sample.py, eval.py, plan.py).

A bad flag or file costs one line and exit code 2, never a traceback, and names what to give:

    minipar: error: argument --gpu-memory: 80 has no unit: give e.g. 80GB or 80GiB (plan.py --help ...)
    minipar: error: --tokenizer loop.json is a symlink loop (a link that leads back to itself): ...

    Parser             argparse, with its errors one line (an InputError), not a usage block
    positive_int ...   argparse types: a number in its range, a size with a unit, a file, a folder
    inside             a path written in a file stays in the folder the user gave
    new_folder         what a script writes: built beside the target, renamed into place; a target
                       holding anything is refused (nothing a user owns is overwritten or mixed into)
    short_enough       each name in a path fits the file system (255 bytes), or one line up front
    refusals()         a script's checks: any InputError (or other ValueError, OSError) -> one line, exit 2

Why the file checks: a FIFO given as a file blocks its reader forever, a symlink loop reads as "no
such file", and a path read from a file (a shard list, a cache key) may climb out with `..`.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from minipar.run.paths import InputError, folder_path, regular_file, temporary_name


class Parser(argparse.ArgumentParser):
    """argparse, but a flag it cannot parse is one line like every other refusal, not a usage block;
    and "-80GB" after a flag is its value (which the flag's type refuses), not an unknown flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")  # what argparse reads as a value, not a flag

    def error(self, message):
        raise InputError(f"{message} ({self.prog} --help lists every flag)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help, unless the help says its default in words already or
    the default is None (the help then says what leaving the flag out does)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Refusal(SystemExit):
    """Exit code 2, after the one line is printed; str() is that line (for callers of main())."""

    def __init__(self, line: str):
        super().__init__(2)
        self.line = line

    def __str__(self):
        return self.line


def refuse(message: str):
    """Print `minipar: error: message` as one line on stderr and exit with code 2."""
    line = "minipar: error: " + " ".join(str(message).split("\n"))
    print(line, file=sys.stderr, flush=True)
    raise Refusal(line)


@contextmanager
def refusals():
    """A script's parsing and checks: a bad input (InputError and the other ValueErrors minipar
    raises, naming the file: CheckpointError, DataError, HFError; an OSError) is one line, exit 2."""
    try:
        yield
    except (ValueError, OSError) as e:
        refuse(str(e))


# ----------------------------------------------------------------------------------------------
# argparse types: each returns the value or raises ArgumentTypeError; argparse names the flag.
# ----------------------------------------------------------------------------------------------


def _number(text: str, kind):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if kind is int else 'a number'}") \
            from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number: give one")
    return value


def _ranged(kind: type, fine: Callable, want: str) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` that `fine` accepts, else "out of range: give `want`"."""
    def parse(text: str) -> Any:
        value = _number(text, kind)
        if not fine(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {want}")
        return value
    return parse


positive_int = _ranged(int, lambda v: v >= 1, "1 or more")
non_negative_int = _ranged(int, lambda v: v >= 0, "0 or more")
positive_float = _ranged(float, lambda v: v > 0, "a number above 0")
non_negative_float = _ranged(float, lambda v: v >= 0, "0 or more")
fraction = _ranged(float, lambda v: 0 < v <= 1, "a fraction above 0, at most 1 (0.45 is 45%)")  # a share, a probability


UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_size(text: str) -> int:
    """A size with its unit: 80GB (10^9 bytes each) or 80GiB (2^30); a bare number is ambiguous."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in UNITS and match.group(2):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give a number and a unit, e.g. 80GB or 80GiB")
    if not match.group(2):
        raise argparse.ArgumentTypeError(f"{text} has no unit: give e.g. {text}GB or {text}GiB")
    value = _number(match.group(1), float) * UNITS[match.group(2).upper()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a size of 1 byte or more")
    return round(value)


def existing_file(text: str) -> Path:
    try:
        return regular_file(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def existing_folder(text: str) -> Path:
    try:
        return folder_path(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------


def inside(base: str | Path, relative: str | Path, name: str) -> Path:
    """base / relative, if it stays inside `base` as written: no `..` that climbs out, no absolute
    path elsewhere. (Links inside `base` are followed as usual: a Hugging Face cache's snapshot
    folder links each file to its blob.) `name` says where the path came from."""
    base = Path(os.path.normpath(Path(base).expanduser()))
    joined = Path(os.path.normpath(base / relative))
    if base not in joined.parents:
        raise InputError(f"{name}: {str(relative)!r} leads outside {base}; the paths a file names must stay in "
                         f"its folder")
    return joined


NAME_MAX = 255  # bytes in one name of a path: Linux's file systems (ext4, xfs, btrfs, tmpfs) and macOS's


def short_enough(path: str | Path, name: str) -> Path:
    """`path` (~ expanded) if each of its names fits the file system: a longer one passes every other
    check and fails only when it is made (ENAMETOOLONG)."""
    p = Path(path).expanduser()
    for part in p.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise InputError(f"{name}: the name {part[:20]}... is {len(os.fsencode(part))} bytes, more than the "
                             f"{NAME_MAX} a file system takes in one name: give a shorter one")
    return p


def unoccupied(path: str | Path, name: str, source: str | Path | None = None) -> Path:
    """`path` (~ expanded) if nothing is there, or an empty folder, and not inside `source` (what
    the script reads): the only places a script may write. Anything else is one line."""
    p = short_enough(path, name)
    if source is not None and Path(os.path.realpath(source)) in Path(os.path.realpath(p)).parents:
        raise InputError(f"{name} {p} is inside {source}, which it is made from: give a folder outside it")
    if os.path.lexists(p) and not (p.is_dir() and not p.is_symlink() and not any(p.iterdir())):
        what = "is a file" if not p.is_dir() else "is a link" if p.is_symlink() else "holds files"
        raise InputError(f"{name} {p} {what}: nothing is written over or into what is there; give a new or empty "
                         f"folder (or move that one away)")
    return p


@contextmanager
def new_folder(path: str | Path, name: str, source: str | Path | None = None) -> Iterator[Path]:
    """A temporary folder beside `path` (which must be `unoccupied`), renamed to `path` when the
    block ends without an error: a reader never sees it half-written, and a failure leaves nothing.
    rename(2) itself refuses a folder filled or a file made there meanwhile."""
    target = unoccupied(path, name, source)
    tmp = target.with_name(temporary_name())
    try:
        tmp.mkdir(parents=True)  # never exist_ok: whatever is there already is not ours
    except OSError as e:  # a parent that is a file, a read-only folder
        raise InputError(f"{name} {target}: cannot create a folder beside it ({e.strerror}): give a folder path "
                         f"you can write") from None
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError as e:
            raise InputError(f"{name} {target} was filled while this ran ({e.strerror}): nothing was written "
                             f"there; give a new or empty folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
