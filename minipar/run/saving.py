"""The checkpoint policy: when the loop saves, and what it never saves; and the stop at Ctrl-C.

A run saves after every `--save-every` steps, after its last, and where Ctrl-C stopped it (unless
--no-save-on-interrupt). Every rank helps: the tp shards and pp stages are gathered into full tensors
(checkpoint.gather_full), rank 0 writes them with the data's fingerprint and tokenizer
(checkpoint.save: a hidden folder, renamed when whole), and the others wait for it. A non-finite
weight anywhere stops the run instead (`TrainingStopped`, exit 3): nothing bad is ever saved, and
the last good checkpoint stays the newest.

Ctrl-C is a normal way to stop (`Interrupt`). Each rank's part in the step's metrics gather says
whether it was interrupted (run_log.py), so every rank learns it after the same step: none is left
waiting in a collective. They save there, rank 0 names the step and the checkpoint in one line,
and the run exits 130 (a torchrun worker 0: torchrun --max-restarts must not start it again).
torchrun forwards Ctrl-C to its workers as SIGINT, the terminal may signal them too, and SIGTERM
follows when torchrun dies: a repeat within a second is the same Ctrl-C. A later one (the user's
second), or one before the steps begin (no step's end to agree on), stops at once: one line, 130.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import asdict

import torch

from minipar.collectives import all_reduce
from minipar.data_parallel import GradSync
from minipar.mesh import Mesh
from minipar.run import checkpoint
from minipar.run.batches import TokenData
from minipar.run.config import TrainConfig
from minipar.run.run_log import RunLog


class TrainingStopped(RuntimeError):
    """The run cannot go on (it diverged); the message says why and what to do."""


def is_due(cfg: TrainConfig, step: int) -> bool:
    """Save after step `step` (counted from 1)? Every --save-every steps, and at the end."""
    return step == cfg.steps or (cfg.save_every > 0 and step % cfg.save_every == 0)


def save(cfg: TrainConfig, step: int, consumed: int, wrapper: GradSync, mesh: Mesh, log: RunLog,
         data: TokenData, quiet: bool = False) -> None:
    """The checkpoint of step `step`, every rank helping (see the module docstring); rank 0 says
    "saved PATH" unless `quiet` (a stop's one line names it)."""
    with wrapper.gathered():
        finite = torch.tensor([float(all(torch.isfinite(p).all() for p in wrapper.module.parameters()))],
                              device=next(wrapper.module.parameters()).device)
    all_reduce(finite, log.group, op="min")  # every rank decides alike
    if not finite.item():
        raise TrainingStopped(f"not saving step {step}: the weights hold non-finite values (the run diverged); the "
                              f"last good checkpoint in {cfg.out} is kept: resume from it with a lower --lr and "
                              f"--allow-config-change")
    states = wrapper.state_by_name()
    with wrapper.gathered():  # ZeRO-3: the weights are sharded
        full = checkpoint.gather_full(wrapper.module, states, checkpoint.hyper_params(wrapper.optimizer),
                                      mesh.groups())
    failure = ""
    if log.is_main:
        state = {"step": step, "consumed": consumed, "config": asdict(cfg), "data_key": data.fingerprint,
                 "model_config": asdict(wrapper.module.config)}  # what the weights are of (sample.py, convert.py)
        try:
            path = checkpoint.save(cfg.out, step, *full, state, data.tokenizer_file)
            if not quiet:
                log.say(f"saved {path}")
        except checkpoint.CheckpointError as e:  # a full disk: nothing partial is left
            failure = str(e)
    failed = torch.tensor([float(bool(failure))], device=finite.device)
    all_reduce(failed, log.group, op="max")  # the others wait for rank 0 here, and learn whether it saved
    if failed.item():
        raise TrainingStopped(failure or "rank 0 could not write the checkpoint (its line says why)")


class Interrupt:
    """This process's Ctrl-C handling for one run (see the module docstring), inside `with`. `at`: when
    the first interrupt came (None: none yet); `stepping`: the loop runs, so a stop can wait for the
    end of the step."""

    def __init__(self):
        self.out: str | None = None  # --out, once checked: the line of a stop names its newest checkpoint
        self.at: float | None = None
        self.stepping, self.replaced = False, {}

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():  # the only thread that may set handlers
            self.replaced = {sig: signal.signal(sig, self.heard) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def heard(self, sig: int, frame=None) -> None:
        if self.at is not None and time.monotonic() - self.at < 1.0:
            return  # the same Ctrl-C again: from the terminal and from torchrun, or torchrun's SIGTERM after it
        if sig == signal.SIGTERM and self.at is None:  # no Ctrl-C before: torchrun ending the run, as before
            signal.signal(sig, self.replaced[sig])
            return os.kill(os.getpid(), sig)  # to the handler it replaced: by default, the end
        if self.at is None and self.stepping:  # stop after this step, every rank alike (RunLog.record)
            self.at = time.monotonic()
            return
        if os.environ.get("RANK", "0") == "0":  # the second Ctrl-C, or one before the steps began: at once
            sys.stdout.flush()
            print(f"minipar: interrupted{' again' if self.at else ''}: stopped at once; {resume_hint(self.out)}",
                  file=sys.stderr, flush=True)
            if self.out:
                checkpoint.unlock(self.out)
        os._exit(130)

    def __exit__(self, *exc) -> None:  # the handlers it replaced, back, once a Ctrl-C's copies are all in
        time.sleep(max(0.0, self.at + 1.0 - time.monotonic()) if self.at is not None else 0.0)
        for sig, handler in self.replaced.items():
            signal.signal(sig, handler)


def resume_hint(out: str | None) -> str:
    """What a stopped run resumes from: --out's newest checkpoint, if it has one."""
    newest = checkpoint.checkpoints(out)[-1:] if out else []
    return f"continue with --resume {newest[0]}" if newest else "no checkpoint was saved"
