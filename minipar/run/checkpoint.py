"""Checkpoints in safetensors: full, unsharded tensors by name, whatever the layout that wrote them.

    out/step_000200/
        model.safetensors       every parameter at its single-device shape, by its model name
        optimizer.safetensors   "<param name>/<state>" for each optimizer state tensor
                                (header metadata: the optimizer's hyper-parameters)
        train_state.json        step, windows of data consumed, scheduler state, the config,
                                the data's fingerprint
        tokenizer.json          the tokenizer the run encoded its data with (if it had one)

Because tensors are stored at their single-device shapes (tensor-parallel shards are gathered
first, padding dropped), a checkpoint written at one layout can be loaded at another (torchtitan's
"seed checkpoint" idea): each rank takes the slices it owns.

A checkpoint is written to a hidden temporary folder, flushed to disk (fsync) and renamed into
place only when complete, so a crash while saving never damages an earlier checkpoint, and a
`step_*` folder is always whole; an existing one is never replaced. train_state.json, written
last, holds the sha256 of both tensor files (and of the tokenizer) and of its own contents:
loading checks them and fails with one line naming the bad file; checkpoint_checks.py checks what
a checksum cannot (ranges, names, shapes, finite values). A corrupt checkpoint is never deleted:
`set_aside` moves it out of the way by name. Folders and files take the user's umask.

One run at a time writes into an --out folder: rank 0 holds `out/.lock` (host and pid) for the run;
`out/run_id` names the run (its JSON log's records carry it). minipar clears or replaces only what
it can tell it made: its `.tmp-minipar-<pid>-...` folders, and a lock in its "host pid" form whose
process is gone. Any other name in --out is the user's, never touched (launch.check_paths refuses it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import uuid
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
from minipar.run.args import InputError, folder_path, temporary_name
from minipar.run.checkpoint_checks import CheckpointError, check_state, checked_model_config, state_digest
from minipar.tensor_parallel import padded, piece_of, unshard

FILES = ("model.safetensors", "optimizer.safetensors", "train_state.json")


TEMPORARY = r"\.tmp-minipar-\d+-(step_\d+|run_id)"  # what `save` and `name_run` build, renamed when whole


def checkpoints(folder: str | Path) -> list[Path]:
    """The step_* checkpoints in a folder, oldest first."""
    return sorted((p for p in Path(folder).glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))


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
        verify(p)
        return p
    reasons = []
    for step in reversed(checkpoints(p)):
        try:
            verify(step)
            if skipped is not None:
                skipped.extend(reasons)
            return step
        except CheckpointError as e:
            reasons.append(str(e))
            if corrupt is not None:
                corrupt.append(step)
    raise CheckpointError(f"{flag} {path}: no step_* checkpoint in it verifies" + (
        f" (newest: {reasons[0]})" if reasons else ": neither a checkpoint nor a folder of step_* checkpoints"))


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify(path: Path) -> dict:
    """Check every file of the checkpoint against its checksum; return its train state. Raises
    CheckpointError naming the file."""
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
    check_state(path, state)
    return state


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
    if "model_config" in state:
        return checked_model_config(path, state["model_config"])
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
