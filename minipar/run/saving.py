"""The checkpoint policy: when the loop saves, and what it never saves.

A run saves after every `--save-every` steps, after its last, and where Ctrl-C stopped it. Every
rank helps: the tp shards and pp stages are gathered into full tensors (checkpoint.gather_full),
rank 0 writes them with the data's fingerprint and tokenizer (checkpoint.save: a hidden folder,
renamed when whole), and the others wait for it. A non-finite weight anywhere stops the run instead
(`TrainingStopped`, exit 3): nothing bad is ever saved, and the last good checkpoint stays the newest.

Ctrl-C stops a run after a step every rank agrees on (ops/interrupt.py hears it; whether a rank
heard it travels in the step's metrics gather, run_log.py) and saves that step.
"""

from __future__ import annotations

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
            log.say("" if quiet else f"saved {path}")
        except checkpoint.CheckpointError as e:  # a full disk: nothing partial is left
            failure = str(e)
    failed = torch.tensor([float(bool(failure))], device=finite.device)
    all_reduce(failed, log.group, op="max")  # the others wait for rank 0 here, and learn whether it saved
    if failed.item():
        raise TrainingStopped(failure or "rank 0 could not write the checkpoint (its line says why)")
