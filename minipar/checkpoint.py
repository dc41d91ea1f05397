"""Checkpoints in safetensors: full, unsharded tensors by name, whatever the layout that wrote them.

    out/step_000200/
        model.safetensors       every parameter at its single-device shape, by its model name
        optimizer.safetensors   "<param name>/<state>" for each optimizer state tensor
                                (header metadata: the optimizer's hyper-parameters)
        train_state.json        step, windows of data consumed, scheduler state, the config

Because tensors are stored at their single-device shapes (tensor-parallel shards are gathered
first, padding dropped), a checkpoint written at one layout can be loaded at another (torchtitan's
"seed checkpoint" idea): each rank takes the slices it owns.

A checkpoint is written to a hidden temporary folder and renamed into place only when complete,
so a crash while saving never damages an earlier checkpoint, and a `step_*` folder is always whole.
Loading checks every file first and fails with one line naming the bad file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from minipar.collectives import Group
from minipar.placement import placement_of
from minipar.tensor_parallel import shard, unshard

FILES = ("model.safetensors", "optimizer.safetensors", "train_state.json")


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint; the message says which and what to do."""


def step_dir(out: str | Path, step: int) -> Path:
    return Path(out) / f"step_{step:06d}"


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or an --out folder whose newest step_* checkpoint is taken."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"--resume {path}: no such folder")
    if not (p / "train_state.json").exists():
        steps = sorted(p.glob("step_*"))
        if not steps:
            raise CheckpointError(f"--resume {path}: neither a checkpoint nor a folder of step_* checkpoints")
        p = steps[-1]
    return p


def verify(path: Path) -> dict:
    """Open every file of the checkpoint; return its train state. Raises CheckpointError."""
    for name in FILES:
        if not (path / name).exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing; resume from another one")
    try:
        state = json.loads((path / "train_state.json").read_text())
        for name in FILES[:2]:
            load_file(path / name)
    except (SafetensorError, json.JSONDecodeError, OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt ({e}); resume from another one") from None
    return state


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A torch optimizer's state by parameter name: {name: {slot: tensor}}."""
    return {n: dict(optimizer.state[p]) for n, p in model.named_parameters() if p in optimizer.state}


def hyper_params(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Learning rate, betas, weight decay... of each parameter group (stored as metadata)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def set_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, states: dict) -> None:
    params = dict(model.named_parameters())
    for name, slots in states.items():
        for slot, value in slots.items():
            optimizer.state[params[name]][slot] = value


def gather_full(model: nn.Module, states: dict, hyper: list, tp_group: Group, pp_group: Group | None = None):
    """Every parameter and optimizer state (`states`: {name: {slot: tensor}}, this rank's shards) at
    its single-device shape, by name.

    A collective over the tp group (shards joined) and the pp group (stages collected on pp rank
    0): call it on every rank; the result on global rank 0 is the whole model.
    Returns (weights, optimizer tensors, optimizer hyper-parameters), the arguments of `save`.
    """
    weights, tensors = {}, {}
    for name, p in model.named_parameters():
        # A copy, not a view: under ZeRO-3 the weights vanish again once gathered() ends.
        weights[name] = unshard(p.detach(), p, tp_group).to("cpu", copy=True).contiguous()
        for slot, value in states.get(name, {}).items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            if t.shape == p.shape:  # exp_avg, exp_avg_sq: sharded like the parameter
                t = unshard(t.detach().to(p.device), p, tp_group)
            tensors[f"{name}/{slot}"] = t.detach().cpu().contiguous()
    if pp_group is not None and pp_group.size > 1:  # each stage holds different layers: collect them
        parts = [None] * pp_group.size if pp_group.rank == 0 else None
        torch.distributed.gather_object((weights, tensors), parts, dst=pp_group.ranks[0], group=pp_group.pg)
        if pp_group.rank == 0:
            weights = {k: v for part_weights, _ in parts for k, v in part_weights.items()}
            tensors = {k: v for _, part_tensors in parts for k, v in part_tensors.items()}
    return weights, tensors, hyper


def save(out: str | Path, step: int, weights: dict, optimizer_tensors: dict, hyper: list, train_state: dict) -> Path:
    """Write one checkpoint from `gather_full`'s output (call on one rank)."""
    final = step_dir(out, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
    try:
        save_file(weights, tmp / "model.safetensors")
        save_file(optimizer_tensors, tmp / "optimizer.safetensors", metadata={"param_groups": json.dumps(hyper)})
        (tmp / "train_state.json").write_text(json.dumps(train_state, indent=1))
        old = final.with_name(f".old-{final.name}")
        if final.exists():  # re-saving a step: the old copy is deleted only once the new one is in place
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load(path: Path, model: nn.Module, tp_group: Group | None = None) -> tuple[dict, dict]:
    """Load weights into an already built model, each rank taking its tp shard of the
    single-device tensors (and only its pipeline stage's parameters).

    Returns (the train state, this rank's optimizer state {name: {slot: tensor}}, sharded like the
    parameters) for the gradient-sync wrapper's `load_state_by_name`.
    """
    tp_group = tp_group or Group.solo("tp")
    state = verify(path)
    weights = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())  # a pipeline stage has only some of them
    missing = set(params) - set(weights)
    if missing:
        raise CheckpointError(f"checkpoint {path} does not match the model (lacks {sorted(missing)[:3]}...)")
    with torch.no_grad():
        for name, p in params.items():
            full_shape = placement_of(p).full_shape
            if tuple(weights[name].shape) != tuple(full_shape):
                raise CheckpointError(
                    f"checkpoint {path}: {name} has shape {tuple(weights[name].shape)}, the model "
                    f"{tuple(full_shape)}: resume with the same --model and data"
                )
            p.copy_(shard(weights[name], p, tp_group))
    states: dict[str, dict] = {}
    for key, value in load_file(path / "optimizer.safetensors").items():
        name, slot = key.rsplit("/", 1)
        if name not in params:
            continue  # another pipeline stage's
        p = params[name]
        if slot != "step":
            value = shard(value, p, tp_group).to(device=p.device, dtype=p.dtype).clone()
        states.setdefault(name, {})[slot] = value
    return state, states
