"""Checkpoints in safetensors: full, unsharded tensors by name, whatever the layout that wrote them.

    out/step_000200/
        model.safetensors       every parameter at its single-device shape, by its model name
        optimizer.safetensors   "<param name>/<state>" for each optimizer state tensor
                                (header metadata: the optimizer's hyper-parameters)
        train_state.json        step, windows of data consumed, scheduler state, the config

Because tensors are stored at their single-device shapes, a checkpoint written at one layout can
be loaded at another (torchtitan's "seed checkpoint" idea): each rank takes the slices it owns.

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


def _optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{names[id(p)]}/{key}"] = t.detach().cpu().contiguous()
    return out


def save(out: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict) -> Path:
    """Write one checkpoint (call on one rank; with only data parallelism every replica is whole)."""
    final = step_dir(out, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
    try:
        save_file({n: p.detach().cpu().contiguous() for n, p in model.state_dict().items()},
                  tmp / "model.safetensors")
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        save_file(_optimizer_tensors(model, optimizer), tmp / "optimizer.safetensors",
                  metadata={"param_groups": json.dumps(hyper)})
        (tmp / "train_state.json").write_text(json.dumps(train_state, indent=1))
        old = final.with_name(f".old-{final.name}")
        if final.exists():  # re-saving a step: the old copy is deleted only once the new one is in place
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimizer state) into an already built model; return the train state."""
    state = verify(path)
    weights = load_file(path / "model.safetensors")
    missing = set(model.state_dict()) ^ set(weights)
    if missing:
        raise CheckpointError(f"checkpoint {path} does not match the model (differs in {sorted(missing)[:3]}...)")
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.shape != weights[name].shape:
                raise CheckpointError(
                    f"checkpoint {path}: {name} has shape {tuple(weights[name].shape)}, the model "
                    f"{tuple(t.shape)}: resume with the same --model and data"
                )
            t.copy_(weights[name])
    if optimizer is not None:
        tensors = load_file(path / "optimizer.safetensors")
        params = dict(model.named_parameters())
        for key, value in tensors.items():
            name, slot = key.rsplit("/", 1)
            p = params[name]
            optimizer.state[p][slot] = value.to(p.device) if slot != "step" else value
    return state
