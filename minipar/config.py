"""The run's configuration: one dataclass, its command line, and the checks made before any
process group exists.

Every check here runs on every rank *before* torch.distributed starts, so a layout that cannot
work is refused with one line instead of eight ranks waiting forever for each other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from minipar.context_parallel import check_cp_layout
from minipar.data import check_data, data_key, read_tokenizer
from minipar.expert_parallel import check_expert_layout
from minipar.mesh import MeshLayout
from minipar.model import CONFIGS
from minipar.pipeline import stage_layers
from minipar.pipeline_schedules import SCHEDULES, ScheduleError
from minipar.pipeline_schedules import build as build_schedule
from minipar.pipeline_schedules import placement as schedule_placement
from minipar.tensor_parallel import check_tensor_layout


class ConfigError(ValueError):
    """A bad command line; the message says what to change."""


@dataclass
class TrainConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism, carved out of dp x cp (mixture-of-experts models)
    sp: bool = False  # Megatron sequence parallelism inside the tp group
    schedule: str = "1f1b"  # pipeline schedule, used when pp > 1
    virtual_stages: int = 1
    zero: int = 0  # ZeRO stage over the dp group: 0 (plain data parallelism), 1, 2, 3
    offload: bool = False  # ZeRO 1-2: optimizer state and step on the CPU
    recompute: bool = False  # activation checkpointing per transformer layer
    model: str = "small"
    aux_loss_coef: float = 0.01  # MoE load-balancing loss weight
    capacity_factor: float = 0.0  # MoE: 0 is dropless
    data: str | None = None
    vocab_size: int = 4096
    tokenizer: str | None = None  # a Hugging Face tokenizer.json; None: a BPE trained on the data
    token_dtype: str = "uint16"  # of .bin token files
    val_fraction: float = 0.0  # documents held out for validation
    eval_every: int = 0  # steps between validations (0: at the end only)
    eval_batches: int = 4  # global batches of held-out windows per validation
    cache_dir: str = "~/.cache/minipar"
    steps: int = 300
    seq_len: int = 128
    global_batch: int = 16
    micro_batch: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_bad_steps: int = 3  # consecutive steps with a non-finite gradient norm before the run stops
    timeout: float = 300.0  # seconds a collective or message may wait before the run stops, naming it
    seed: int = 0
    dtype: str | None = None  # None: bfloat16 autocast on CUDA, float32 on CPU
    bucket_mb: float = 25.0
    out: str | None = None  # None: runs/run_NNN, the first unused number
    save_every: int = 0
    resume: str | None = None
    wandb: bool = True
    log_json: str | None = None
    log_every: int = 10
    allow_config_change: bool = False  # --resume: accept a changed data, batch, seed or learning-rate schedule
    plan: bool = False  # print what each rank will hold (estimate.py) and exit

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank (gradient accumulation)."""
        return self.global_batch // (self.dp * self.micro_batch)

    def check_ranges(self, max_seq_len: int) -> None:
        """Every number in its range, every path flag not empty: one line naming the flag."""
        rules = (  # (setting, whether its value is fine, what to give instead)
            ("steps", self.steps >= 1, "1 or more"),
            ("seq_len", 1 <= self.seq_len <= max_seq_len, f"1 to --model {self.model}'s max_seq_len, {max_seq_len}"),
            ("global_batch", self.global_batch >= 1, "1 or more"),
            ("micro_batch", self.micro_batch >= 1, "1 or more"),
            ("max_bad_steps", self.max_bad_steps >= 1, "1 or more"),
            ("vocab_size", 257 <= self.vocab_size < 2**32, "257 (the 256 bytes and <|endoftext|>) to 2**32 - 1"),
            ("lr", 0 < self.lr < math.inf, "a learning rate above 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "a fraction of --lr from 0 to 1"),
            ("warmup", self.warmup >= 0, "0 or more steps"),
            ("weight_decay", 0 <= self.weight_decay < math.inf, "0 or more"),
            ("grad_clip", 0 <= self.grad_clip < math.inf, "0 (off) or more"),
            ("bucket_mb", 0 < self.bucket_mb < math.inf, "a size above 0"),
            ("aux_loss_coef", 0 <= self.aux_loss_coef < math.inf, "0 or more"),
            ("capacity_factor", 0 <= self.capacity_factor < math.inf, "0 (dropless) or more"),
            ("timeout", 0 < self.timeout < math.inf, "the seconds an operation may wait, above 0"),
            ("seed", 0 <= self.seed < 2**32, "0 to 2**32 - 1"),
            ("save_every", self.save_every >= 0, "0 (only at the end) or more steps"),
            ("log_every", self.log_every >= 1, "1 or more steps"),
            ("val_fraction", 0 <= self.val_fraction < 1, "a fraction of the documents, from 0 to below 1"),
            ("eval_every", self.eval_every >= 0 and (self.val_fraction > 0 or self.eval_every == 0),
             "0 (at the end) or more steps, with --val-fraction above 0"),
            ("eval_batches", self.eval_batches >= 1, "1 or more global batches"),
            ("virtual_stages", self.virtual_stages == 1 or self.virtual_stages > 1 and self.pp > 1,
             "1, or more with --pp > 1"),
        )
        for name, fine, want in rules:
            if not fine:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: give {want}")
        for name in ("data", "tokenizer", "cache_dir", "out", "resume", "log_json"):
            if getattr(self, name) == "":
                raise ConfigError(f"--{name.replace('_', '-')} is empty: give a path, or leave the flag out")

    def validate(self, world_size: int) -> None:
        """Ranges first, then what the model and data can take, then whether the world has the right size."""
        m = CONFIGS[self.model]
        self.check_ranges(m.max_seq_len)
        try:
            check_tensor_layout(m.n_heads, m.n_kv_heads, m.dim, m.ffn_dim, self.tp, self.sp, self.seq_len)
        except ValueError as e:
            raise ConfigError(f"{e} (--model {self.model})") from None
        if self.global_batch % (self.dp * self.micro_batch):
            raise ConfigError(
                f"--global-batch {self.global_batch} is not divisible by --dp {self.dp} x --micro-batch "
                f"{self.micro_batch}: every rank must run whole micro-batches"
            )
        try:
            check_cp_layout(self.seq_len, self.cp)
            check_expert_layout(m.n_experts, m.top_k, self.ep, self.dp * self.cp)
        except ValueError as e:
            raise ConfigError(f"{e} (--model {self.model})" if "expert" in str(e) else str(e)) from None
        if self.sp and (self.seq_len // self.cp) % self.tp:
            raise ConfigError(f"--sp with --cp {self.cp}: each rank's {self.seq_len // self.cp} tokens do not "
                              f"split over --tp {self.tp}")
        if self.pp > 1:
            try:
                stages = len(schedule_placement(self.schedule, self.pp, self.virtual_stages))  # zbv: 2 per rank
                stage_layers(m.n_layers, stages)  # raises: more stages than layers
                build_schedule(self.schedule, self.pp, self.accum_steps, self.virtual_stages)
            except ScheduleError as e:
                raise ConfigError(
                    f"{e} (micro-batches per step = --global-batch / (--dp x --micro-batch) = {self.accum_steps})"
                ) from None
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero {self.zero}: choose 0, 1, 2 or 3")
        if self.zero == 3 and self.pp > 1:
            raise ConfigError("--zero 3 with --pp: every micro-batch would gather each layer twice; "
                              "use --zero 1 or 2 with pipeline parallelism")
        if self.zero == 3 and self.recompute:
            raise ConfigError("--zero 3 with --recompute is not supported: choose one")
        if self.offload and self.zero not in (1, 2):
            raise ConfigError("--offload needs --zero 1 or 2: it moves ZeRO's optimizer slices to the CPU")
        if self.dtype not in (None, "float32", "float64", "bfloat16"):
            raise ConfigError(f"--dtype {self.dtype}: choose float32, float64 or bfloat16")
        MeshLayout(world_size, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)  # raises LayoutError


class Parser(argparse.ArgumentParser):
    """argparse, but a flag it cannot parse is one line like every other refusal, not a usage block."""

    def error(self, message):
        raise ConfigError(f"{message} (train.py --help lists every flag)")


def parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = Parser(
        prog="train.py",
        description="Train a Llama-style model with minipar. Launch with torchrun for more than one rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("layout (dp x tp x pp x cp must equal the number of ranks)")
    for dim, help_ in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")):
        g.add_argument(f"--{dim}", type=int, default=1, help=f"{help_}-parallel degree")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree, carved out of dp x cp (MoE models)")
    g.add_argument("--sp", action="store_true", help="sequence parallelism in the norm/residual regions (tp > 1)")
    g.add_argument("--schedule", default=d.schedule, choices=SCHEDULES, help="pipeline schedule (pp > 1)")
    g.add_argument("--virtual-stages", type=int, default=1, help="chunks per pipeline rank (interleaved)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=d.model, choices=list(CONFIGS), help="named model size")
    g.add_argument("--aux-loss-coef", type=float, default=d.aux_loss_coef, help="MoE load-balancing loss weight")
    g.add_argument("--capacity-factor", type=float, default=d.capacity_factor,
                   help="MoE: tokens an expert takes, x its fair share (0: dropless, every token served)")
    g.add_argument("--seq-len", type=int, default=d.seq_len)
    data_arguments(p.add_argument_group("data and validation"), d)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per step, all dp ranks")
    g.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per forward on one rank")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor, as a fraction of --lr")
    g.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max global gradient norm (0: off)")
    g.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds a collective or message may wait (a stopped or dead rank) before the run stops")
    g.add_argument("--max-bad-steps", type=int, default=d.max_bad_steps,
                   help="stop after this many consecutive steps with a non-finite loss or gradient (each is skipped)")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16"],
                   help="compute dtype (default: bfloat16 autocast on CUDA, float32 on CPU)")
    g.add_argument("--bucket-mb", type=float, default=d.bucket_mb, help="data-parallel gradient bucket size")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage over the dp group: 0, 1, 2 or 3")
    g.add_argument("--offload", action="store_true", help="ZeRO 1-2: optimizer state and update on the CPU")
    g.add_argument("--recompute", action="store_true", help="activation checkpointing per transformer layer")
    g = p.add_argument_group("checkpoints and logs")
    g.add_argument("--out", default=None, help="checkpoint directory (default: runs/run_NNN, a new one)")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    g.add_argument("--resume", default=None, help="a checkpoint folder, an --out folder (its newest that verifies), "
                   "or auto: --out's newest if it has one, else start fresh (for torchrun --max-restarts)")
    g.add_argument("--allow-config-change", action="store_true",
                   help="--resume with another --data, --seq-len, --global-batch, --seed or learning-rate schedule")
    g.add_argument("--plan", action="store_true", help="print what each rank will hold under these flags, and exit")
    g.add_argument("--no-wandb", dest="wandb", action="store_false", help="do not log to wandb")
    g.add_argument("--log-json", default=None, help="write one JSON object per step to this file")
    g.add_argument("--log-every", type=int, default=d.log_every, help="print a log line every N steps")
    return p


def data_arguments(g, d: TrainConfig) -> None:
    g.add_argument("--data", default=None, help="a text file or folder, or .bin token files (default: the Python "
                   "standard library)")
    g.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary trained on the data")
    g.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json (default: a BPE trained on --data)")
    g.add_argument("--token-dtype", default=d.token_dtype, choices=["uint16", "uint32"],
                   help="the ids' type in .bin token files (nanoGPT's format: a bare array)")
    g.add_argument("--cache-dir", default=d.cache_dir, help="where tokenised data is kept")
    g.add_argument("--val-fraction", type=float, default=d.val_fraction,
                   help="hold out this fraction of the documents (files) for validation, chosen by --seed")
    g.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="validation loss every N steps (0: at the end only; needs --val-fraction)")
    g.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="global batches of held-out windows per validation")


def parse_args(argv=None) -> TrainConfig:
    args = parser().parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items()})
    layout = cfg.dp * cfg.tp * cfg.pp * cfg.cp  # --plan: the ranks the flags ask for, none launched
    cfg.validate(layout if cfg.plan else int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


# ----------------------------------------------------------------------------------------------
# Checks that need the file system, called by train.check_paths before any process group
# ----------------------------------------------------------------------------------------------

# What a resumed run must share with the checkpoint's run; the layout and --steps may change.
RESUMED_SETTINGS = ("model", "vocab_size", "data", "seq_len", "global_batch", "seed", "lr", "min_lr_ratio", "warmup")
DATA_SETTINGS = ("val_fraction",)  # resumed alike too; a checkpoint from before them had the default


def check_files(cfg: TrainConfig, resume: Path | None) -> None:
    """The data is text, the places this rank writes take a file, the checkpoint fits this run."""
    check_data(cfg.data, cfg.seq_len, cfg.vocab_size, cfg.cache_dir, cfg.tokenizer, cfg.token_dtype)
    check_writable("--cache-dir", cfg.cache_dir)
    if os.environ.get("RANK", "0") == "0":  # only rank 0 writes checkpoints and the JSON log
        check_writable("--out", cfg.out)
        if cfg.log_json:
            check_writable("--log-json", cfg.log_json, file=True)
    if resume is not None:
        check_resume(cfg, json.loads((resume / "train_state.json").read_text()), resume)


def check_writable(flag: str, path: str, file: bool = False) -> None:
    """Make and delete a file where `path` will be written: in its folder (file=True), or in the
    nearest folder of `path` that exists. Nothing is left behind, not even a new folder."""
    p = Path(path).expanduser()
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


def check_resume(cfg: TrainConfig, state: dict, path: Path) -> None:
    """A resumed run continues the saved one: RESUMED_SETTINGS must match (--allow-config-change
    accepts a change, but never of the model or vocabulary: the weights would not fit), and the
    checkpoint must be short of --steps (--resume auto, a restart, may find the run finished)."""
    saved = state.get("config") if isinstance(state, dict) else None
    if not (isinstance(saved, dict) and isinstance(state.get("step"), int) and "consumed" in state
            and set(RESUMED_SETTINGS) <= saved.keys()):
        raise ConfigError(f"checkpoint {path} is corrupt: its train_state.json lacks the step, the data consumed or "
                          f"the run's settings; resume from another one")
    if state["step"] >= cfg.steps and cfg.resume != "auto":
        raise ConfigError(f"nothing to do: the checkpoint {path} is at step {state['step']}; pass --steps above "
                          f"{state['step']} to train further")
    for name in RESUMED_SETTINGS + DATA_SETTINGS:
        old, new, flag = saved.get(name, getattr(TrainConfig, name)), getattr(cfg, name), "--" + name.replace("_", "-")
        same = old == new or (name == "data" and old and new and Path(old).resolve() == Path(new).resolve())
        if not same and (name in ("model", "vocab_size") or not cfg.allow_config_change):
            keep = f"pass {flag} {old}" if old is not None else f"leave {flag} out"
            also = "" if name in ("model", "vocab_size") else ", or --allow-config-change to accept the change"
            raise ConfigError(f"{flag} {new} differs from the checkpoint's {old} ({path}): {keep} to continue it{also}")
    changed = state.get("data_key") and state["data_key"] != data_key(cfg.data, cfg.vocab_size, cfg.token_dtype)
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
