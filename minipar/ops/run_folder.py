"""The --out folder of a run, claimed and kept: which checkpoint to trust, one run at a time, and
nothing of a user's touched. The operating tier: a first reading skips it.

One run at a time writes into an --out folder: rank 0 holds `out/.lock` (host and pid) for the run;
`out/run_id` names the run (its JSON log's records carry it). minipar clears or replaces only what
it can tell it made: its `.tmp-minipar-<pid>-...` folders, and a lock in its "host pid" form whose
process is gone. Any other name in --out is the user's, never touched (cli.check_paths refuses it).
A checkpoint that does not verify is never deleted: `set_aside` moves it out of the way by name.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from minipar.ops.checkpoint_checks import verified
from minipar.run.checkpoint import CheckpointError, checkpoints
from minipar.run.paths import InputError, folder_path, temporary_name

TEMPORARY = r"\.tmp-minipar-\d+-(step_\d+|run_id)"  # what `save` and `name_run` build, renamed when whole


def not_a_runs(out: str | Path) -> list[str]:
    """The names in an --out folder that no run of minipar writes there (sorted)."""
    own = re.compile(rf"step_\d+(\.corrupt(-\d+)?)?|{TEMPORARY}|\.lock|run_id|wandb|wandb_run_id|traces")
    folder = Path(out).expanduser()
    return sorted(p.name for p in folder.iterdir() if not own.fullmatch(p.name)) if folder.is_dir() else []


def resolve(path: str | Path, skipped: list[str] | None = None, flag: str = "--resume",
            corrupt: list[Path] | None = None) -> Path:
    """A checkpoint folder, which must verify, or an --out folder whose newest step_* checkpoint
    that verifies is taken; why each newer one was skipped is appended to `skipped`, the folder
    itself to `corrupt` (for `set_aside`)."""
    p = Path(path).expanduser()
    if not os.path.lexists(p):
        raise CheckpointError(f"{flag} {path}: no such folder")
    try:
        folder_path(p, f"{flag} {path}")  # a symlink loop, a broken link, a file
    except InputError as e:
        raise CheckpointError(str(e)) from None
    if (p / "train_state.json").exists() or p.name.startswith("step_"):
        verified(p)
        return p
    reasons = []
    for step in reversed(checkpoints(p)):
        try:
            verified(step)
            if skipped is not None:
                skipped.extend(reasons)
            return step
        except CheckpointError as e:
            reasons.append(str(e))
            if corrupt is not None:
                corrupt.append(step)
    raise CheckpointError(f"{flag} {path}: no step_* checkpoint in it verifies" + (
        f" (newest: {reasons[0]})" if reasons else ": neither a checkpoint nor a folder of step_* checkpoints"))


def set_aside(folder: Path) -> Path:
    """Move a checkpoint that does not verify out of the way, by name (never deleted: it may be
    worth a look): step_000008 -> step_000008.corrupt (.corrupt-2, ... if taken). `checkpoints`
    no longer lists it, so a run can save that step again."""
    target, n = folder.with_name(f"{folder.name}.corrupt"), 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.corrupt-{n}")
    os.rename(folder, target)
    return target


def lock(out: str | Path) -> list[str]:
    """Rank 0 claims --out for this run: `out/.lock` holds "host pid". A lock whose process is gone
    (same host, pid not alive: a crash, or torchrun restarting rank 0) is taken over; then the
    temporary folders of interrupted saves are removed. Returns notes for the log."""
    out, notes, me = Path(out), [], f"{socket.gethostname()} {os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(out / ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except FileExistsError:
        notes.append(stale_lock(out / ".lock"))  # raises unless it is minipar's and its run is gone
        (out / ".lock").unlink(missing_ok=True)
        fd = os.open(out / ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        os.write(fd, me.encode())
    except OSError:  # a full disk: the empty file is ours (O_EXCL made it), and would read as someone else's
        (out / ".lock").unlink()
        raise
    finally:
        os.close(fd)
    for tmp in out.iterdir():  # only the lock holder saves here: these are from a crash
        if re.fullmatch(TEMPORARY, tmp.name):
            shutil.rmtree(tmp, ignore_errors=True)
            notes.append(f"removed {tmp.name}, left by an interrupted save")
    return notes


def stale_lock(path: Path) -> str:
    """Why the lock at `path` may be taken over (a note for the log): it is minipar's ("host pid")
    and that pid is not alive on this host. Otherwise CheckpointError: its run may be alive, or it
    is not minipar's (another tool's, or a run between creating it and writing it, microseconds).
    A lock that is not minipar's is never deleted."""
    try:
        words = path.read_text(errors="replace").split()
    except FileNotFoundError:  # given back meanwhile
        return "the lock of a run that just ended was gone when taken"
    if len(words) != 2 or not words[1].isdigit():
        raise CheckpointError(f"--out {path.parent} holds a .lock that is not minipar's (\"host pid\"): another "
                              f"program's, or a run claiming --out this very moment; minipar never deletes it: "
                              f"pass another --out, or remove {path} if it is yours and unused")
    host, pid = words
    if host != socket.gethostname() or pid_alive(int(pid)):
        raise CheckpointError(f"--out {path.parent} is in use by another run (host {host}, pid {pid}); wait for it, "
                              f"or pass another --out (delete {path} if that run is gone)")
    return f"took over the lock of a run that is gone (host {host}, pid {pid})"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but another user's
        return True
    return True


def unlock(out: str | Path) -> None:
    """Give --out back at the end of the run (only our own lock)."""
    path = Path(out) / ".lock"
    if path.exists() and path.read_text() == f"{socket.gethostname()} {os.getpid()}":
        path.unlink()


def run_id(out: str | Path) -> str | None:
    """The id of the run in --out (`out/run_id`, 12 hex digits), or None if it has none yet. A file
    of that name in another form is not minipar's: CheckpointError (it is never replaced)."""
    path = Path(out).expanduser() / "run_id"
    if not os.path.lexists(path):
        return None
    text = path.read_text(errors="replace").strip() if path.is_file() else ""
    if not re.fullmatch(r"[0-9a-f]{12}", text):
        raise CheckpointError(f"--out {path.parent} holds a run_id that is not minipar's (12 hex digits): "
                              f"give a new or empty folder")
    return text


def name_run(out: str | Path, kept: str | None) -> str:
    """Rank 0, holding the lock: write this run's id to `out/run_id` and return it: `kept` (a
    resumed run's), else a new one (a new run: an id left by an earlier attempt that saved nothing
    is replaced, as minipar's own)."""
    new = kept or uuid.uuid4().hex[:12]
    if new != run_id(out):
        tmp = Path(out) / temporary_name("run_id")
        tmp.write_text(new)
        os.replace(tmp, Path(out) / "run_id")
    return new
