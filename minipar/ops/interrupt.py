"""Ctrl-C (SIGINT) as a normal way to stop a run, and the command that continues it. The operating
tier: a first reading skips it.

Whether a rank heard Ctrl-C travels in the step's metrics gather (run_log.py), so every rank stops
after the same step, saves it (saving.py) and none waits in a collective. torchrun passes a Ctrl-C
on to its workers, a terminal may signal them too, SIGTERM may follow: a repeat within a second is
the same Ctrl-C. A later one, or one before the steps, stops at once. The stop line prints the
whole command that started the run, with --resume in it (`rerun_command`).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from minipar.ops.run_folder import unlock
from minipar.run.checkpoint import checkpoints


class Interrupt:
    """Ctrl-C's handling in this process, inside `with` (see the module docstring)."""

    out: str | None = None  # --out, once checked: a stop's line names its newest checkpoint
    at: float | None = None  # when the first Ctrl-C came (time.monotonic); None: none yet
    stepping = False  # the steps have begun: a Ctrl-C waits for the end of the step
    replaced: dict = {}  # the handlers it replaced, put back at the end

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():  # the only thread that may set handlers
            self.replaced = {s: signal.signal(s, self.heard) or signal.SIG_DFL for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def heard(self, sig: int, frame=None) -> None:
        if self.at is not None and time.monotonic() - self.at < 1.0:
            return  # the same Ctrl-C again: from the terminal and from torchrun, or torchrun's SIGTERM after it
        if sig == signal.SIGTERM and self.at is None:  # no Ctrl-C before: torchrun ending the run, as ever
            signal.signal(sig, self.replaced[sig])
            return os.kill(os.getpid(), sig)  # to the handler it replaced: by default, the end
        if self.at is None and self.stepping:  # stop after this step, every rank alike (RunLog.record)
            self.at = time.monotonic()
            return
        if os.environ.get("RANK", "0") == "0":  # a second Ctrl-C, or one before the steps: at once
            sys.stdout.flush()
            from tqdm import tqdm  # the progress bar's line cleared first: the stop's line stands alone
            tqdm.write(f"minipar: interrupted{' again' if self.at else ''}: stopped at once; {resume_hint(self.out)}",
                       file=sys.stderr)
            sys.stderr.flush()
            if self.out:
                unlock(self.out)
        os._exit(130)

    def resume_hint(self, out: str | None) -> str:
        """What the loop's stop line says (train.train_loop): the command that continues the run."""
        return resume_hint(out)

    def __exit__(self, *exc) -> None:
        if self.at is not None:  # the handlers back once the copies of a Ctrl-C are all in
            time.sleep(max(0.0, self.at + 1.0 - time.monotonic()))
        for sig, handler in self.replaced.items():
            signal.signal(sig, handler)


def resume_hint(out: str | None) -> str:
    """What a stopped run resumes from: --out's newest checkpoint, if it has one, as a command to paste."""
    newest = checkpoints(out)[-1:] if out else []
    return f"continue with: {rerun_command(newest[0])}" if newest else "no checkpoint was saved"


def rerun_command(resume: Path) -> str:
    """The command that started this run, as it was typed, with `--resume resume` in place of its own:
    `make train`'s (MINIPAR_MAKE_ARGS: its ARGS), train.py's launcher's (MINIPAR_COMMAND: its argv), a
    bare torchrun's (its workers cannot see its options: the usual ones), or one process's."""
    def without_resume(argv: list[str]) -> list[str]:
        drop = {i for i, a in enumerate(argv) if a == "--resume"}
        return [a for i, a in enumerate(argv) if i not in drop and i - 1 not in drop and not a.startswith("--resume=")]

    def shown(path: str) -> str:  # .venv/bin/python rather than /home/.../.venv/bin/python
        relative = os.path.relpath(path)
        return relative if not relative.startswith("..") else path
    if "MINIPAR_MAKE_ARGS" in os.environ:
        args = [*without_resume(shlex.split(os.environ["MINIPAR_MAKE_ARGS"])), "--resume", str(resume)]
        return f"make train ARGS={shlex.quote(shlex.join(args))}"
    if "MINIPAR_COMMAND" in os.environ:
        argv = json.loads(os.environ["MINIPAR_COMMAND"])
        argv = [shown(sys.executable), shown(argv[0]), *argv[1:]]
    elif "LOCAL_WORLD_SIZE" in os.environ:
        argv = ["torchrun", f"--nproc-per-node={os.environ['LOCAL_WORLD_SIZE']}", shown(sys.argv[0]), *sys.argv[1:]]
    else:
        argv = [shown(sys.executable), shown(sys.argv[0]), *sys.argv[1:]]
    return shlex.join([*without_resume(argv), "--resume", str(resume)])
