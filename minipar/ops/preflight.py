"""Checks that need the file system, made by launch.check_paths on every rank before any process
group exists: the data reads and its tokens fit the model, each place this rank writes takes a
file, a checkpoint to resume continues this very run, weights to start from are this model's.

config.py checks what the settings say on their own; this file checks them against the disk.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import fields
from pathlib import Path

import torch

from minipar.layout import SHAPE_FLAGS
from minipar.model import CONFIGS, ModelConfig
from minipar.ops.args import short_enough
from minipar.ops.checkpoint_checks import check_tensors, model_config_of
from minipar.precision import of_config, resolve
from minipar.run.checkpoint import FROM_WEIGHTS
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.data import (
    DataError,
    are_token_files,
    cached,
    check_encodes,
    check_text,
    corpus_key,
    data_key,
    find_files,
    prepare,
    read_tokenizer,
)
from minipar.run.paths import regular_file
from minipar.run.run_log import json_log_records

# What a resumed run must share with the checkpoint's run; the layout and --steps may change.
# WEIGHT_SETTINGS never (the weights would not fit); --max-seq-len may grow (no weight has its size).
WEIGHT_SETTINGS = ("model", *(name for name in SHAPE_FLAGS if name != "max_seq_len"), "tie_embeddings")
RESUMED_SETTINGS = (*WEIGHT_SETTINGS, "optimizer", "data", "bpe_vocab", "seq_len", "global_batch", "seed", "lr",
                    "muon_lr", "min_lr_ratio", "warmup", "val_fraction")
NEVER_CHANGED = (*WEIGHT_SETTINGS, "optimizer")  # nor the optimizer: its saved state is another's (Muon's, AdamW's)


def check_files(cfg: TrainConfig, resume: Path | None, run_id: str | None = None) -> None:
    """The data reads and fits the model, the places this rank writes take a file (a resumed run's
    JSON log is its own: `run_id`, --out's), the checkpoint (or the weights to start from) fits this run."""
    vocab = check_data(cfg.data, cfg.seq_len, cfg.bpe_vocab, cfg.cache_dir, cfg.tokenizer, cfg.token_dtype)
    model_vocab = cfg.model_config().vocab_size
    if vocab is not None and vocab > model_vocab:
        what = f"--tokenizer {cfg.tokenizer} has {vocab} tokens" if cfg.tokenizer else \
            f"--data {cfg.data} holds token ids up to {vocab - 1}"
        raise ConfigError(f"{what}, more than the model's vocabulary of {model_vocab}: pass --vocab-size {vocab} "
                          f"or more")
    check_writable("--cache-dir", cfg.cache_dir)
    if os.environ.get("RANK", "0") == "0":  # only rank 0 writes checkpoints and the JSON log
        check_writable("--out", cfg.out)
        if cfg.log_json:
            check_writable("--log-json", cfg.log_json, file=True)
            check_json_log(cfg.log_json, cfg.resume is not None, run_id)
    if resume is not None:
        state = json.loads((resume / "train_state.json").read_text())
        check_resume(cfg, state, resume)
        # names, shapes, finite, AdamW's state whole: before any process group
        check_tensors(resume, model_config_of(resume, state), one_step=cfg.zero >= 1, muon=cfg.optimizer == "muon")
    if cfg.init_from:
        check_init_from(cfg, Path(cfg.init_from))


def check_writable(flag: str, path: str, file: bool = False) -> None:
    """Make and delete a file where `path` will be written: in its folder (file=True), or in the
    nearest folder of `path` that exists. Nothing is left behind, not even a new folder."""
    p = short_enough(path, flag)
    if p.exists() and p.is_dir() == file:
        kind, want = ("a folder", "a file") if file else ("a file", "a folder")
        raise ConfigError(f"{flag} {path} is {kind}: give {want}")
    folder = p.parent if file else next(q for q in (p, *p.parents) if q.exists())
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".minipar-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write in {folder} ({e.strerror}); choose another place") from None


def check_json_log(path: str, resumed: bool, run_id: str | None) -> None:
    """--log-json never rewrites a file this run did not make: a new run's is a new file; a resumed
    run's, if it exists, holds only records of this run (the id kept in --out: `run_id`, None if it
    has none), which run_log.open_json_log may cut back to the step resumed."""
    log = Path(path).expanduser()
    if not os.path.lexists(log):
        return
    if not resumed:
        raise ConfigError(f"--log-json {path} exists: a new run never appends to a file; give a new file (a run "
                          f"continued with --resume appends to its own)")
    ids = {r.get("run_id") for r in json_log_records(regular_file(log, f"--log-json {path}"))}  # not a FIFO
    if ids != {run_id} or run_id is None:
        found = ", ".join(sorted(map(str, ids))) or "no records"
        raise ConfigError(f"--log-json {path} is not this run's log (its records' run id: {found}; this run's, in "
                          f"--out: {run_id or 'none yet'}): a resumed run appends only to its own; give a new file")


def check_resume(cfg: TrainConfig, state: dict, path: Path) -> None:
    """A resumed run continues the saved one: RESUMED_SETTINGS must match (--allow-config-change
    accepts a change, but never of NEVER_CHANGED: the weights or optimizer state would not fit), and the
    checkpoint must be short of --steps (--resume auto, a restart, may find the run finished).
    A setting a checkpoint from before it lacks had its default then."""
    saved = state.get("config") if isinstance(state, dict) else None
    if not (isinstance(saved, dict) and isinstance(state.get("step"), int) and "consumed" in state
            and {"model", "data", "seq_len", "global_batch", "seed"} <= saved.keys()):
        raise ConfigError(f"checkpoint {path} is corrupt: its train_state.json lacks the step, the data consumed or "
                          f"the run's settings; resume from another one")
    if saved["model"] not in CONFIGS:  # convert.py's import ("imported"): weights to start a run from
        raise ConfigError(f"{path} holds imported weights (--model {saved['model']}), not a run to continue: start "
                          f"from them with --init-from {path} and the shape flags of their model")
    if state["step"] >= cfg.steps and cfg.resume != "auto":
        raise ConfigError(f"nothing to do: the checkpoint {path} is at step {state['step']}; pass --steps above "
                          f"{state['step']} to train further")
    before = saved_settings(path, state)
    for name in RESUMED_SETTINGS:
        old, new, flag = before[name], getattr(cfg, name), "--" + name.replace("_", "-")
        same = old == new or (name == "data" and old and new and Path(old).resolve() == Path(new).resolve())
        if not same and (name in NEVER_CHANGED or not cfg.allow_config_change):
            keep = f"pass {flag if old else '--no-' + flag[2:]}" if isinstance(old, bool) else \
                f"pass {flag} {old}" if old is not None else f"leave {flag} out"
            also = "" if name in NEVER_CHANGED else ", or --allow-config-change to accept the change"
            raise ConfigError(f"{flag} {new} differs from the checkpoint's {old} ({path}): {keep} to continue it{also}")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a default precision is the device's
    was, now = resolve(before["precision"], before["dtype"], None, device).name, of_config(cfg, device).name
    if was != now and {"precision", "dtype"} & saved.keys():  # the dtypes of weights and moments, every rounding
        if not cfg.allow_config_change:
            keep = f"--precision {was}" if was else "--dtype float64"
            raise ConfigError(f"precision {now or 'float64'} differs from the checkpoint's {was or 'float64'} "
                              f"({path}): pass {keep} to continue it, or --allow-config-change to accept the change")
        if os.environ.get("RANK", "0") == "0":
            print(f"minipar: precision changes from the checkpoint's {was or 'float64'} to {now or 'float64'} "
                  f"(--allow-config-change)", flush=True)
    changed = state.get("data_key") and state["data_key"] != data_key(cfg.data, cfg.bpe_vocab, cfg.token_dtype)
    if changed and not cfg.allow_config_change:
        raise ConfigError(f"--data {cfg.data or '(the standard library)'} is not the data of {path}: its files' names, "
                          f"sizes or times changed (or the run moved machines, or --token-dtype), so its tokens "
                          f"would too; restore them, or pass --allow-config-change to go on with it (encoded by the "
                          f"checkpoint's tokenizer, if it keeps one)")
    if cfg.tokenizer and (path / "tokenizer.json").exists():  # compared by what they encode, not their bytes
        old, new = (read_tokenizer(p, separator=True) for p in (path / "tokenizer.json", cfg.tokenizer))
        fits = old.get_vocab_size() == new.get_vocab_size()
        if not fits or (old.to_str() != new.to_str() and not cfg.allow_config_change):
            raise ConfigError(f"--tokenizer {cfg.tokenizer} is not the tokenizer of {path} (its ids would differ): "
                              f"leave --tokenizer out to use the checkpoint's" + (
                                  ", or pass --allow-config-change" if fits else f" (its {new.get_vocab_size()} ids "
                                  f"do not fit the weights' {old.get_vocab_size()})"))


def saved_settings(path: Path, state: dict) -> dict:
    """The checkpoint's run settings, its model's shape written in: a checkpoint from before the
    shape flags saved only --model (and the BPE's size as vocab_size); then the defaults."""
    saved, model = state["config"], model_config_of(path, state)
    shape = {name: getattr(model, name) for name in (*SHAPE_FLAGS, "tie_embeddings") if saved.get(name) is None}
    old_bpe = {"bpe_vocab": saved["vocab_size"]} if "bpe_vocab" not in saved and "vocab_size" in saved else {}
    return {**{f.name: f.default for f in fields(TrainConfig)}, **old_bpe,
            **{k: v for k, v in saved.items() if v is not None}, **shape}


def check_init_from(cfg: TrainConfig, path: Path) -> None:
    """The weights are of the model this run builds: every setting alike but FROM_WEIGHTS and the
    MoE loss's. (`path` was verified when launch.check_paths resolved it.)"""
    saved = model_config_of(path, json.loads((path / "train_state.json").read_text()))
    check_tensors(path, saved, optimizer=False)  # names, shapes, finite: before any process group
    run = cfg.model_config()
    for name in (f.name for f in fields(ModelConfig)):
        old, new = getattr(saved, name), getattr(run, name)
        if old != new and name not in (*FROM_WEIGHTS, "aux_loss_coef", "capacity_factor"):
            flag = "--" + name.replace("_", "-")
            hint = (f"pass {flag} {old}" if name in SHAPE_FLAGS else
                    f"pass {flag if old else '--no-' + flag[2:]}" if name == "tie_embeddings" else
                    "choose the --model those weights have the shape of")
            raise ConfigError(f"--init-from {path}: its model has {name} {old}, this run's (--model {cfg.model}) "
                              f"{new}: {hint}")


def check_data(path: str | None, seq_len: int, vocab_size: int, cache_dir: str | Path,
               tokenizer: str | None = None, token_dtype: str = "uint16") -> int | None:
    """Before any process group: the tokenizer loads; token files are scanned (prepared: cheap);
    text files are UTF-8 with enough of it for one window of seq_len + 1 tokens (byte-level BPE
    makes at most one token per byte, plus one <|endoftext|> per file). The standard library,
    and a corpus tokenised before, are not read again. Returns the ids the data will use, where
    known before tokenising (a tokenizer's, token files'), for the caller to fit in the model."""
    files = find_files(path)
    tok = read_tokenizer(tokenizer, separator=True) if tokenizer is not None else None
    vocab = tok.get_vocab_size() if tok is not None else None
    if are_token_files(path, files):
        count = json.loads((prepare(path, vocab_size, cache_dir, tokenizer, token_dtype) / "meta.json").read_text())
        if count["num_tokens"] <= seq_len:
            raise DataError(f"--data {path} holds {count['num_tokens']} token ids, fewer than one window of --seq-len "
                            f"{seq_len} + 1: give more or a shorter --seq-len")
        return count["vocab_size"]
    if tok is not None:
        check_encodes(tok, tokenizer)
    if path is None or cached(Path(cache_dir).expanduser() / corpus_key(files, vocab_size), files):
        return vocab
    size = sum(check_text(f) for f in files)
    if size + len(files) <= seq_len:
        raise DataError(f"--data {path} holds {size} bytes of text, fewer than one window of --seq-len {seq_len} "
                        f"+ 1 tokens: give more text or a shorter --seq-len")
    return vocab
