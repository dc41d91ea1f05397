"""The paths a run reads and writes, checked as it meets them: a file that can be read without
blocking (a FIFO given as a file blocks its reader forever; a symlink loop reads as "no such
file"), a folder, and minipar's own temporary names. ops/args.py holds the rest of the command
line's checks, which run before any of this (a first reading skips them).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path


class InputError(ValueError):
    """A bad command line or input file; the message names it and says what to give instead."""


def temporary_name(what: str = "") -> str:
    """A name for something minipar builds and renames into place: `.tmp-minipar-<pid>-<what or a
    random tag>`. The marker says it is minipar's (only such names are ever cleared); its length
    does not grow with the target's, so it fits wherever the target's name fits."""
    return f".tmp-minipar-{os.getpid()}-{what or secrets.token_hex(4)}"


def _stat(path: Path, name: str) -> os.stat_result:
    """The stat of what `path` leads to, or one line: missing, a broken link, a loop, unreadable."""
    try:
        return path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InputError(f"{name} is a symlink loop (a link that leads back to itself): point it at a real "
                             f"file or folder") from None
        if e.errno == errno.ENOENT:
            what = "a broken link (its target is gone)" if path.is_symlink() else "no such file or directory"
            raise InputError(f"{name}: {what}") from None
        raise InputError(f"{name}: cannot read it ({e.strerror})") from None


def regular_file(path: str | Path, name: str | None = None) -> Path:
    """`path` (~ expanded) if it is a regular file, or a link to one; a FIFO, a device or a socket
    would block or never end, a folder is not a file. `name` says it in the message (a flag and path)."""
    p, name = Path(path).expanduser(), name or str(path)
    mode = _stat(p, name).st_mode
    if stat.S_ISDIR(mode):
        raise InputError(f"{name} is a folder: give a file")
    if not stat.S_ISREG(mode):
        raise InputError(f"{name} is not a regular file (a FIFO, socket or device, which would block or never "
                         f"end): give a file")
    return p


def regular_if_present(path: str | Path, name: str | None = None) -> Path:
    """regular_file, but a path with nothing there passes: its reader says so in its own words."""
    p = Path(path).expanduser()
    return regular_file(p, name or str(path)) if os.path.lexists(p) else p


def folder_path(path: str | Path, name: str | None = None) -> Path:
    """`path` (~ expanded) if it is a folder, or a link to one."""
    p, name = Path(path).expanduser(), name or str(path)
    if not stat.S_ISDIR(_stat(p, name).st_mode):
        raise InputError(f"{name} is not a folder: give a folder")
    return p
