"""What a checkpoint must hold before a run trusts it (checkpoint.py reads and writes them).

A checkpoint's checksums (train_state.json's "sha256") catch a flipped bit or a truncated file;
these checks catch what a checksum cannot: a train state out of its range, a model_config no
model has, tensors of the wrong name, shape or value. They run on every rank before any process
group starts (cli.check_paths), so a bad checkpoint costs one line, not a traceback on each
rank mid-step:

    train_state.json      step >= 0 and this folder's; windows consumed >= the step; the
                          settings and the model objects; its own checksum (`state_digest`)
    model.safetensors     exactly the model's parameters, single-device shapes, finite
    optimizer.safetensors every parameter all of AdamW's state, or none does; shapes, finite;
                          under ZeRO one step count for all
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch
from safetensors import safe_open

from minipar import moe  # noqa: F401 - a checkpoint may hold experts: moe.py adds their block to the model
from minipar.model import Llama, ModelConfig
from minipar.muon import is_muon
from minipar.run import checkpoint
from minipar.run.checkpoint import CheckpointError, verify


def verified(path: Path) -> dict:
    """checkpoint.verify's checksums, then the train state's fields (`check_state`): the train state."""
    state = verify(path)
    check_state(path, state)
    return state


def model_config_of(path: Path, state: dict) -> ModelConfig:
    """checkpoint.model_config_of, the model_config checked first (`checked_model_config`)."""
    return checked_model_config(path, state["model_config"]) if "model_config" in state else \
        checkpoint.model_config_of(path, state)


def check_state(path: Path, state: dict) -> None:
    """Each field of a train state in its range: a step that is this folder's (a step of -5 would
    train with a negative learning rate), windows consumed a whole number, at least one per step
    in a train.py checkpoint (one with its settings; not exactly step x --global-batch: a resume
    with --allow-config-change may change the batch mid-run), the settings and the model as
    objects. Extra fields (convert.py's `source`) are kept."""
    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)
    step, consumed = state.get("step"), state.get("consumed")
    least = step if "config" in state and is_int(step) else 0
    number = int(path.name[5:]) if path.name.startswith("step_") and path.name[5:].isdigit() else None
    problem = (
        "no step, or one that is not a whole number >= 0" if not is_int(step) or step < 0 else
        f"step {step} in the folder of step {number}" if number is not None and step != number else
        f"a windows-consumed count that is not a whole number >= {least}" if not is_int(consumed) or consumed < least
        else "settings (config) that are not an object" if not isinstance(state.get("config", {}), dict)
        else "a model_config that is not an object" if not isinstance(state.get("model_config", {}), dict)
        else "a data_key that is not text" if not isinstance(state.get("data_key", ""), str) else None)
    if problem:
        raise CheckpointError(f"checkpoint {path} is corrupt: its train_state.json has {problem}; resume from "
                              f"another one")


def checked_model_config(path: Path, saved: dict) -> ModelConfig:
    """A checkpoint's model_config, refused in one line when it names a setting this minipar lacks
    (from a newer version, or edited) or holds sizes no model has."""
    known = {f.name for f in fields(ModelConfig)}
    if not isinstance(saved, dict) or set(saved) - known:
        raise CheckpointError(f"checkpoint {path}: its model_config has settings this minipar does not know "
                              f"({sorted(set(saved) - known)[:3] if isinstance(saved, dict) else saved!r}); "
                              f"use the minipar that wrote it, or convert it")
    config = ModelConfig(**saved)
    sizes = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
    bad = [n for n in sizes if not isinstance(getattr(config, n), int) or getattr(config, n) < 1]
    try:
        if bad:
            raise ValueError(f"{bad[0]} {getattr(config, bad[0])!r} is not a size of 1 or more")
        config.validate()
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: its model_config is no model ({e}); resume from another one") \
            from None
    return config


def check_tensors(path: Path, config: ModelConfig, optimizer: bool = True, one_step: bool = False,
                  muon: bool = False) -> None:
    """The module docstring's checks of model.safetensors, and of optimizer.safetensors if `optimizer`.
    Every tensor is read, one at a time (memory: the largest tensor), every rank: as long as
    verify's checksum, which reads the files once already."""
    with torch.device("meta"):  # names and shapes only: nothing is allocated
        shapes = {n: tuple(p.shape) for n, p in Llama(config).named_parameters()}
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        if names != shapes.keys():
            odd = sorted(shapes.keys() - names)[:2] or sorted(names - shapes.keys())[:2]
            raise CheckpointError(f"checkpoint {path}: model.safetensors does not hold its model's parameters "
                                  f"({'lacks' if shapes.keys() - names else 'has unknown'} {odd}); resume from "
                                  f"another one")
        for name in sorted(names):
            check_tensor(path, "model.safetensors", name, f.get_tensor(name), shapes[name])
    if optimizer:
        check_optimizer(path, shapes, one_step, muon)


def check_optimizer(path: Path, shapes: dict, one_step: bool, muon: bool = False) -> None:
    """optimizer.safetensors holds, for every parameter of `shapes`, all of its optimizer's state
    (AdamW's: exp_avg and exp_avg_sq at its shape, a finite scalar step; with `muon`, the blocks'
    matrices hold Muon's momentum_buffer instead) or, for every one, none (an import; a run saves it
    for all). one_step (--zero >= 1): every step count alike, since a ZeRO bucket flattens the state
    of several parameters and keeps one count for them all; a partial state would be a KeyError, or
    a count silently taken from another parameter, mid-load."""
    wanted = {name: MUON_SLOTS if muon and is_muon(name, len(shape)) else ADAMW_SLOTS for name, shape in shapes.items()}
    kind = "Muon or AdamW" if muon else "AdamW"
    slots: dict[str, set] = {}
    steps: dict[str, float] = {}
    with safe_open(path / "optimizer.safetensors", "pt") as f:
        for key in sorted(f.keys()):
            name, _, slot = key.rpartition("/")
            if name not in shapes or slot not in wanted[name]:
                raise CheckpointError(f"checkpoint {path}: optimizer.safetensors holds {key!r}, no {kind} state of "
                                      f"the model; resume from another one")
            value = f.get_tensor(key)
            check_tensor(path, "optimizer.safetensors", key, value, () if slot == "step" else shapes[name])
            slots.setdefault(name, set()).add(slot)
            if slot == "step":
                steps[name] = value.item()
    for name, held in slots.items():
        if held != set(wanted[name]):
            raise CheckpointError(f"checkpoint {path}: optimizer.safetensors lacks {name}/"
                                  f"{sorted(set(wanted[name]) - held)[0]} (it has {sorted(held)}); resume from another "
                                  f"one")
    if slots and slots.keys() != shapes.keys():
        none = sorted(shapes.keys() - slots.keys())
        raise CheckpointError(f"checkpoint {path}: optimizer.safetensors holds {kind} state for {len(slots)} of the "
                              f"{len(shapes)} parameters, none for {none[0]}{' ...' if len(none) > 1 else ''} (a run "
                              f"saves it for all of them or none); resume from another one")
    if one_step and len(set(steps.values())) > 1:
        (low, n), (high, m) = min(steps.items(), key=lambda s: s[1]), max(steps.items(), key=lambda s: s[1])
        raise CheckpointError(f"checkpoint {path}: optimizer.safetensors's AdamW step counts differ ({low} at {n:g}, "
                              f"{high} at {m:g}), and a ZeRO bucket keeps one count for its parameters: resume with "
                              f"--zero 0, or from another checkpoint")


ADAMW_SLOTS = ("exp_avg", "exp_avg_sq", "step")
MUON_SLOTS = ("momentum_buffer",)


def check_tensor(path: Path, file: str, name: str, value: torch.Tensor, shape: tuple) -> None:
    if tuple(value.shape) != tuple(shape):
        raise CheckpointError(f"checkpoint {path}: {name} in {file} has shape {tuple(value.shape)}, its model "
                              f"{tuple(shape)}; resume from another one")
    if value.is_floating_point() and not torch.isfinite(value).all():
        raise CheckpointError(f"checkpoint {path}: {name} in {file} is not finite; resume from an earlier one")


