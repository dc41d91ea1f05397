"""Checkpoints in safetensors: full, unsharded tensors by name, whatever the layout that wrote them.

    out/step_000200/
        model.safetensors       every parameter at its single-device shape, by its model name
        optimizer.safetensors   "<param name>/<state>" for each optimizer state tensor
                                (header metadata: the optimizer's hyper-parameters)
        train_state.json        step, windows consumed, the config, the data's fingerprint, and
                                the sha256 of every file (and of its own contents)
        tokenizer.json          the tokenizer the run encoded its data with (if it had one)

Tensors are stored at their single-device shapes (tensor-parallel shards gathered, padding
dropped), so a checkpoint written at one layout loads at another: each rank takes its slices.
A checkpoint is written to a temporary folder, fsynced and renamed into place only when whole:
a crash while saving never damages an earlier one, and none is ever replaced. Which checkpoint to
trust, and the --out folder's lock, are ops/run_folder.py's; what a checksum cannot catch,
ops/checkpoint_checks.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from minipar.collectives import gather_object
from minipar.mesh import Groups
from minipar.model import CONFIGS, ModelConfig, get_config
from minipar.placement import placement_of
from minipar.run.paths import temporary_name
from minipar.tensor_parallel import padded, piece_of, unshard

FILES = ("model.safetensors", "optimizer.safetensors", "train_state.json")


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint; the message says which and what to do."""


def state_digest(state: dict) -> str:
    """The sha256 of a train state (without its checksums), as JSON with sorted keys: the same
    bytes whatever the order or indentation the file was written with."""
    return hashlib.sha256(json.dumps(state, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checkpoints(folder: str | Path) -> list[Path]:
    """The step_* checkpoints in a folder, oldest first."""
    return sorted((p for p in Path(folder).glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(path: Path) -> dict:
    """Check every file of the checkpoint against its checksum; return its train state. Raises
    CheckpointError naming the file. (ops/checkpoint_checks.verified adds what a checksum cannot see.)"""
    for name in FILES:
        if not (path / name).exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing; resume from another one")
    try:
        state = json.loads((path / "train_state.json").read_text())
        sums = state.pop("sha256")
        if "train_state" in sums and state_digest(state) != sums["train_state"]:  # absent: saved before it was kept
            raise CheckpointError(f"checkpoint {path} is corrupt: train_state.json does not match its checksum "
                                  f"(edited by hand?); resume from another one")
        for name in FILES[:2] + (("tokenizer.json",) if "tokenizer.json" in sums else ()):
            if sha256(path / name) != sums[name]:  # a flipped bit, a truncated or overwritten file
                raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match its checksum; "
                                      f"resume from another one")
    except (json.JSONDecodeError, KeyError, TypeError) as e:  # no checksums, or not JSON
        raise CheckpointError(f"checkpoint {path} is corrupt (train_state.json: {e!r}); resume from another one") \
            from None
    except OSError as e:  # names the file
        raise CheckpointError(f"checkpoint {path} cannot be read ({e}); resume from another one") from None
    return state


def hyper_params(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Learning rate, betas, weight decay... of each parameter group (stored as metadata)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def gather_full(model: nn.Module, states: dict, hyper: list, groups: Groups) -> tuple[dict, dict, list]:
    """Every parameter and optimizer state (`states`: {name: {slot: tensor}}, this rank's shards) at
    its single-device shape, by name: a collective over the groups that cut parameters (tp, ep:
    shards joined) and pp (stages collected on pp rank 0), so call it on every rank; global rank 0
    gets the whole model. Returns (weights, optimizer tensors, `hyper`), the arguments of `save`."""
    weights, tensors = {}, {}
    for name, p in model.named_parameters():
        # A copy, not a view: under ZeRO-3 the weights vanish again once gathered() ends.
        weights[name] = unshard(p.detach(), p, groups).to("cpu", copy=True).contiguous()
        for slot, value in states.get(name, {}).items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            if t.shape == p.shape:  # exp_avg, exp_avg_sq: sharded like the parameter
                t = unshard(t.detach().to(p.device), p, groups)
            tensors[f"{name}/{slot}"] = t.detach().cpu().contiguous()
    if groups.pp.size > 1:  # each stage holds different layers: collect them
        parts = gather_object((weights, tensors), groups.pp)
        if parts is not None:  # pp rank 0
            weights = {k: v for part_weights, _ in parts for k, v in part_weights.items()}
            tensors = {k: v for _, part_tensors in parts for k, v in part_tensors.items()}
    return weights, tensors, hyper


def save(out: str | Path, step: int, weights: dict, optimizer_tensors: dict, hyper: list, train_state: dict,
         tokenizer: Path | None = None) -> Path:
    """Write one checkpoint from `gather_full`'s output (call on one rank), with a copy of the
    `tokenizer` file if given. Never replaces one."""
    final = Path(out) / f"step_{step:06d}"
    if final.exists():
        raise CheckpointError(f"{final} exists already: a checkpoint is never overwritten")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(temporary_name(final.name))
    tmp.mkdir()  # a plain mkdir, not tempfile.mkdtemp: the mode follows the umask instead of 0700
    try:
        save_file(weights, tmp / "model.safetensors")
        save_file(optimizer_tensors, tmp / "optimizer.safetensors", metadata={"param_groups": json.dumps(hyper)})
        names = FILES[:2] + (("tokenizer.json",) if tokenizer else ())
        if tokenizer:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        sums = {name: sha256(tmp / name) for name in names}
        sums["train_state"] = state_digest(json.loads(json.dumps(train_state)))  # as it will read back
        (tmp / "train_state.json").write_text(json.dumps({**train_state, "sha256": sums}, indent=1))
        for name in FILES[:2]:  # safetensors writes 0600: give them the umask's mode, as Python gave the json
            os.chmod(tmp / name, (tmp / "train_state.json").stat().st_mode)
        for path in [tmp / name for name in FILES + names[2:]] + [tmp]:  # on disk before the rename makes it visible
            fsync(path)
        os.rename(tmp, final)
        fsync(final.parent)  # the rename itself
    except (OSError, SafetensorError) as e:  # a full disk: one line; the temporary folder goes, earlier ones stay
        raise CheckpointError(f"cannot write the checkpoint {final} ({str(e).splitlines()[0][:160]}): the earlier "
                              f"checkpoints are whole; free space in {final.parent} and resume") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a folder too: its fsync makes its entries (names) durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: Path, model: nn.Module, groups: Groups | None = None) -> tuple[dict, dict]:
    """Load weights into an already built model, each rank reading only its shard (tp, ep:
    `groups`; None: one device) of the single-device tensors, of its pipeline stage's parameters.
    Returns (the train state, this rank's optimizer state {name: {slot: tensor}}, sharded like the
    parameters) for the gradient-sync wrapper's `load_state_by_name`."""
    groups, state = groups or Groups(), verify(path)
    params = dict(model.named_parameters())  # a pipeline stage has only some of them
    source, fix = f"checkpoint {path}", "resume with the same --model and data"
    with safe_open(path / "model.safetensors", "pt") as f, torch.no_grad():
        missing = set(params) - set(f.keys())
        if missing:
            raise CheckpointError(f"checkpoint {path} does not match the model (lacks {sorted(missing)[:3]}...)")
        for name, p in params.items():
            piece = read_shard(f, name, p, groups, source, fix)
            if not torch.isfinite(piece).all():  # saved so by another tool: refuse rather than train on
                raise CheckpointError(f"checkpoint {path}: {name} in model.safetensors is not finite; "
                                      f"resume from an earlier one")
            p.copy_(piece)
    states: dict[str, dict] = {}
    with safe_open(path / "optimizer.safetensors", "pt") as f:
        for key in f.keys():
            name, slot = key.rsplit("/", 1)
            if name in params:  # else another pipeline stage's
                p = params[name]
                states.setdefault(name, {})[slot] = f.get_tensor(key) if slot == "step" else \
                    read_shard(f, key, p, groups, source, fix).to(p.device, p.dtype).clone()
    return state, states


def saved_model(path: str | Path) -> tuple[str | None, ModelConfig] | None:
    """(preset, ModelConfig) of the checkpoint `path` (or an --out folder's newest), unverified; the
    preset None if imported. None if unreadable: resolving it later says why, in one line."""
    found = checkpoints(path) or [Path(path).expanduser()]
    try:
        state = json.loads((found[-1] / "train_state.json").read_text())
        preset = state["config"]["model"]
        return (preset if preset in CONFIGS else None), model_config_of(found[-1], state)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def model_config_of(path: Path, state: dict) -> ModelConfig:
    """The model a checkpoint's weights are for: stored beside them (train.py, convert.py import),
    or, in a checkpoint from before that, the run's --model with the tokenizer's vocabulary."""
    if "model_config" in state:  # checked before the run (ops/checkpoint_checks.checked_model_config)
        return ModelConfig(**state["model_config"])
    run = state["config"]
    with safe_open(path / "model.safetensors", "pt") as f:
        vocab = f.get_slice("tok_emb.weight").get_shape()[0]
    return get_config(run["model"], vocab_size=vocab, aux_loss_coef=run["aux_loss_coef"],
                      capacity_factor=run["capacity_factor"])


# What --init-from's weights bring with them, whatever the preset says: settings no flag sets, that
# shape no weight (an imported Llama's RoPE and norm), and the MoE loss's, which the run's flags set.
FROM_WEIGHTS = ("rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                "rope_original_max_len", "norm_eps")


def init_model_config(cfg, path: Path) -> ModelConfig:
    """The model a run (`cfg`: its TrainConfig) with --init-from `path` builds: its own shape, the
    weights' FROM_WEIGHTS settings."""
    saved = model_config_of(path, json.loads((path / "train_state.json").read_text()))
    return replace(cfg.model_config(), **{name: getattr(saved, name) for name in FROM_WEIGHTS})


def read_shard(f, name: str, p: nn.Parameter, groups: Groups, source: str, fix: str) -> torch.Tensor:
    """This rank's piece of tensor `name` of an open safetensors file: tensor_parallel.shard's cut
    (`piece_of`), reading only that piece. A shape that is not p's whole shape names `source` and `fix`."""
    full, stored = tuple(placement_of(p).full_shape), tuple(f.get_slice(name).get_shape())
    if stored != full:
        raise CheckpointError(f"{source}: {name} has shape {stored}, the model {full}: {fix}")
    index, pad = piece_of(full, p, groups)
    return padded(f.get_slice(name)[index], pad)


def load_weights(path: Path, model: nn.Module, groups: Groups) -> None:
    """Start from a checkpoint's weights (train.py --init-from): each rank reads only the shards it
    holds of the parameters of its stages, no optimizer state."""
    with safe_open(path / "model.safetensors", "pt") as f, torch.no_grad():
        missing = [name for name, _ in model.named_parameters() if name not in f.keys()]
        if missing:
            raise CheckpointError(f"--init-from {path}: the weights lack {missing[:3]}: they are of another model")
        for name, p in model.named_parameters():
            p.copy_(read_shard(f, name, p, groups, "--init-from", "give the --model (and --vocab-size) of those "
                                                                  "weights"))
