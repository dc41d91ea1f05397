"""The run's configuration: one dataclass, its command line (and `--config run.toml`,
config_file.py), and the checks made before any process group exists.

The model is `--model`'s preset with any shape flag in its place (`--dim 64 --n-layers 2`), its
vocabulary included: `--model 8b` builds the 8B model of the preset, whatever the data. The BPE
trained on `--data` has `--bpe-vocab` tokens (default: the model's vocabulary, at most 4096) and
must fit in the model's; embedding rows beyond it are never used (a `--tokenizer` file, or token
files' ids, must fit too: preflight.py checks them). `parse_args` returns the
effective config, every setting explicit: each run prints it and saves it with each checkpoint.

Every check here (and the layout's own, planning/layout.py's Layout.validate) runs on every rank
*before* torch.distributed starts, so a layout that cannot work is refused with one line instead of
eight ranks waiting forever for each other.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass, fields, replace

from minipar.context_parallel import CP_ATTENTION
from minipar.model import CONFIGS, ModelConfig
from minipar.pipeline.schedules import SCHEDULES
from minipar.planning.layout import Layout
from minipar.run.args import HelpFormatter, InputError, Parser
from minipar.run.config_file import as_toml, read_config_file


class ConfigError(InputError):
    """A bad command line; the message says what to change."""


# Flags that override one field of --model's preset (ModelConfig's field of the same name).
SHAPE_FLAGS = {"dim": "hidden size", "n_layers": "transformer blocks", "n_heads": "attention heads",
               "n_kv_heads": "key/value heads (grouped-query attention)", "ffn_dim": "MLP hidden size",
               "vocab_size": "the model's vocabulary: embedding rows, the tokenizer's must fit",
               "max_seq_len": "longest sequence the run may use"}
# The largest value of each shape flag: 60x Llama 3 405B's widths, 8x its depth; beyond, even the
# estimator's model on paper overflows or takes minutes to build.
SHAPE_MAX = {"dim": 2**20, "n_layers": 1024, "n_heads": 2**14, "n_kv_heads": 2**14, "ffn_dim": 2**22,
             "vocab_size": 2**32, "max_seq_len": 2**24}
BPE_VOCAB = 4096  # the BPE's default size, when the model's vocabulary is larger
MAX_BATCH = 2**24  # sequences in one step: far beyond any run, and its indices stay far inside int64
MAX_TIMEOUT = 1e7  # seconds (115 days): a timedelta, and torch's milliseconds, hold it


@dataclass
class TrainConfig(Layout):
    """A run: its layout, model and batch (planning/layout.py: what the estimator reads and
    Layout.validate checks), then its data, optimisation, checkpoints and logs."""

    error = ConfigError  # Layout.validate's refusals are the command line's

    data: str | None = None
    bpe_vocab: int | None = None  # the BPE trained on --data; None: bpe_size()
    tokenizer: str | None = None  # a Hugging Face tokenizer.json; None: a BPE trained on the data
    token_dtype: str = "uint16"  # of .bin token files
    val_fraction: float = 0.0  # documents held out for validation
    eval_every: int = 0  # steps between validations (0: at the end only)
    eval_batches: int = 4  # global batches of held-out windows per validation
    cache_dir: str = "~/.cache/minipar"
    steps: int = 300
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    grad_clip: float = 1.0
    max_bad_steps: int = 3  # consecutive steps with a non-finite gradient norm before the run stops
    timeout: float = 300.0  # seconds a collective or message may wait before the run stops, naming it
    seed: int = 0
    out: str | None = None  # None: runs/run_NNN, the first unused number
    save_every: int = 0
    resume: str | None = None
    init_from: str | None = None  # start from these weights (convert.py import, or a checkpoint) at step 0
    wandb: bool = True
    log_json: str | None = None
    log_every: int = 10
    allow_config_change: bool = False  # --resume: accept a changed data, batch, seed or learning-rate schedule
    plan: bool = False  # print what each rank will hold (estimate.py) and exit
    config: str | None = None  # the TOML file the settings came from, if any

    def bpe_size(self) -> int:
        """The vocabulary of the BPE trained on --data: --bpe-vocab, else the model's, at most 4096
        (more merges than a small corpus can teach only lengthen training)."""
        return self.bpe_vocab if self.bpe_vocab is not None else min(BPE_VOCAB, self.model_config().vocab_size)

    def resolved(self) -> TrainConfig:
        """The effective config: what the preset and the BPE rule chose, written in."""
        model = self.model_config()
        chosen = {f.name: getattr(model, f.name) for f in fields(ModelConfig)
                  if hasattr(self, f.name) and getattr(self, f.name) is None}
        return replace(self, **chosen, bpe_vocab=self.bpe_size())

    def check_ranges(self, max_seq_len: int) -> None:
        """Every number in its range, every path flag not empty: one line naming the flag."""
        rules = (  # (setting, whether its value is fine, what to give instead)
            ("steps", self.steps >= 1, "1 or more"),
            ("seq_len", 1 <= self.seq_len <= max_seq_len, f"1 to --model {self.model}'s max_seq_len, {max_seq_len}"),
            *((dim, getattr(self, dim) >= 1, "1 or more") for dim in ("dp", "tp", "pp", "cp", "ep")),
            ("ranks_per_node", self.ranks_per_node is None or self.ranks_per_node >= 1, "1 or more"),
            ("global_batch", 1 <= self.global_batch <= MAX_BATCH, f"1 to {MAX_BATCH} sequences"),
            ("micro_batch", 1 <= self.micro_batch <= MAX_BATCH, f"1 to {MAX_BATCH} sequences"),
            ("max_bad_steps", self.max_bad_steps >= 1, "1 or more"),
            *((name, getattr(self, name) is None or 1 <= getattr(self, name) <= SHAPE_MAX[name],
               f"1 to {SHAPE_MAX[name]}") for name in SHAPE_FLAGS),
            ("bpe_vocab", self.bpe_vocab is None or 257 <= self.bpe_vocab < 2**32,
             "257 (the 256 bytes and <|endoftext|>) to 2**32 - 1"),
            ("lr", 0 < self.lr < math.inf, "a learning rate above 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "a fraction of --lr from 0 to 1"),
            ("warmup", self.warmup >= 0, "0 or more steps"),
            ("weight_decay", 0 <= self.weight_decay < math.inf, "0 or more"),
            ("grad_clip", 0 <= self.grad_clip < math.inf, "0 (off) or more"),
            ("bucket_mb", 0 < self.bucket_mb < math.inf, "a size above 0"),
            ("aux_loss_coef", 0 <= self.aux_loss_coef < math.inf, "0 or more"),
            ("capacity_factor", 0 <= self.capacity_factor < math.inf, "0 (dropless) or more"),
            ("timeout", 1 <= self.timeout <= MAX_TIMEOUT, f"the seconds an operation may wait, 1 to {MAX_TIMEOUT:g} "
             f"(below 1 s a healthy step's collectives time out)"),
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
        for name in ("data", "tokenizer", "cache_dir", "out", "resume", "init_from", "log_json", "config"):
            if getattr(self, name) == "":
                raise ConfigError(f"--{name.replace('_', '-')} is empty: give a path, or leave the flag out")

    def validate(self, world_size: int) -> None:
        """Ranges first, then the layout (Layout.validate), what the data can take, where the weights come from."""
        m = self.model_config()
        self.check_ranges(m.max_seq_len)
        super().validate(world_size)
        self.check_vocab(m)
        if self.init_from and self.resume:
            raise ConfigError("--init-from and --resume: choose one (--resume continues a run, --init-from starts one)")

    def check_vocab(self, m: ModelConfig) -> None:
        """The trained BPE's tokens are rows of the model's embedding: it must fit. (A --tokenizer
        is a file: preflight.check_files reads its size.)"""
        if self.tokenizer is not None:
            if self.bpe_vocab is not None:
                raise ConfigError("--bpe-vocab sizes the BPE trained on --data; with --tokenizer leave it out")
            return
        if self.bpe_size() < 257:  # a byte-level BPE has the 256 bytes and <|endoftext|> at least
            given = "--vocab-size" if self.vocab_size is not None else f"--model {self.model}'s vocabulary"
            raise ConfigError(f"{given} {m.vocab_size} cannot hold a byte-level BPE (the 256 bytes and "
                              f"<|endoftext|>): pass --vocab-size 257 or more")
        if self.bpe_size() > m.vocab_size:
            raise ConfigError(f"--bpe-vocab {self.bpe_size()} does not fit in the model's vocabulary of "
                              f"{m.vocab_size}: pass a smaller --bpe-vocab, or --vocab-size {self.bpe_size()} or more")


def add_model_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """--model, the shape flags that override its preset, the MoE weights, and where weights come from."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=d.model, choices=list(CONFIGS), help="named model size: the preset the "
                   "shape flags below override")
    for name, what in SHAPE_FLAGS.items():
        g.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"{what} (default: the preset's)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction,
                   help="the LM head shares the embedding table (default: the preset's; 1b ties)")
    g.add_argument("--aux-loss-coef", type=float, default=d.aux_loss_coef, help="MoE load-balancing loss weight")
    g.add_argument("--capacity-factor", type=float, default=d.capacity_factor,
                   help="MoE: tokens an expert takes, x its fair share (0: dropless, every token served)")
    g.add_argument("--init-from", default=None,
                   help="start from these weights at step 0 with a fresh optimizer: a checkpoint folder, e.g. one "
                   "scripts/convert.py import wrote from a Hugging Face model")


def add_data_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Where the tokens come from, how they are cut, and what is held out to validate on."""
    g = p.add_argument_group("data and validation")
    g.add_argument("--data", default=None, help="a text file or folder, or .bin token files (default: the Python "
                   "standard library)")
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    g.add_argument("--bpe-vocab", type=int, help=f"tokens of the BPE trained on --data; it must fit in the "
                   f"model's vocabulary (default: the model's vocabulary, at most {BPE_VOCAB})")
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


def add_precision_flags(g) -> None:
    """--precision, --dtype and --grad-reduce (how they combine: minipar/precision.py)."""
    g.add_argument("--precision", default=None, choices=["fp32", "bf16-autocast", "bf16-mixed"],
                   help="fp32; bf16-autocast (fp32 weights, bf16 matmuls); bf16-mixed (the ZeRO paper's: bf16 "
                        "weights and gradients, fp32 master weights and Adam state: 16 bytes per parameter). "
                        "Default: fp32 on CPU, bf16-autocast on CUDA")
    g.add_argument("--dtype", default=None, choices=["float32", "float64", "bfloat16"], help="float64: all in "
                   "float64 (proofs; no --precision); float32 = --precision fp32, bfloat16 = bf16-autocast")
    g.add_argument("--grad-reduce", default=None, choices=["bf16", "fp32"],
                   help="bf16-mixed: gradients summed over ranks in bf16 (default: rounded at each of N-1 adds) "
                        "or fp32 (twice the bytes; the mean rounded once, within half a bf16 ulp)")


def parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = Parser(
        prog="train.py",
        description="Train a Llama-style model with minipar. Launch with torchrun for more than one rank.",
        formatter_class=HelpFormatter,
    )
    switch = argparse.BooleanOptionalAction  # --sp and --no-sp: a flag can turn off what --config turned on
    p.add_argument("--config", help="a TOML file of these flags' settings (keys: the flags' names, e.g. "
                   "global-batch = 16); the flags given here override it")
    g = p.add_argument_group("layout (dp x tp x pp x cp must equal the number of ranks)")
    for dim, help_ in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"), ("cp", "context")):
        g.add_argument(f"--{dim}", type=int, default=1, help=f"{help_}-parallel degree")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree, carved out of dp x cp (MoE models)")
    g.add_argument("--cp-attention", default=d.cp_attention, choices=CP_ATTENTION, help="context-parallel "
                   "attention: K/V round a ring, or all-to-alls to whole heads (ulysses: heads / tp must divide by cp)")
    g.add_argument("--sp", action=switch, default=False, help="sequence parallelism in the norm/residual regions "
                   "(tp > 1)")
    g.add_argument("--schedule", default=d.schedule, choices=SCHEDULES, help="pipeline schedule (pp > 1)")
    g.add_argument("--virtual-stages", type=int, default=1, help="chunks per pipeline rank (interleaved)")
    g.add_argument("--ranks-per-node", type=int, help="ranks that share a node (its fast links): the ledger counts "
                   "what crosses between nodes; less than the world simulates several nodes on one machine "
                   "(default: torchrun's LOCAL_WORLD_SIZE, else every rank on one node)")
    add_model_flags(p, d)
    add_data_flags(p, d)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per step, all dp ranks")
    g.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per forward on one rank")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="cosine floor, as a fraction of --lr")
    g.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW's, on matrices only")
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max global gradient norm (0: off)")
    g.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds a collective or message may wait (a stopped or dead rank) before the run stops")
    g.add_argument("--max-bad-steps", type=int, default=d.max_bad_steps,
                   help="stop after this many consecutive steps with a non-finite loss or gradient (each is skipped)")
    g.add_argument("--seed", type=int, default=d.seed, help="weights and data order")
    add_precision_flags(g)
    g.add_argument("--bucket-mb", type=float, default=d.bucket_mb, help="data-parallel gradient bucket size")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage over the dp group: 0, 1, 2 or 3")
    g.add_argument("--zeropp", default=None, help="ZeRO++ on --zero 3: any of qwz,hpz,qgz (int8 forward gather, "
                   "backward gather inside the node, int4 gradients)")
    g.add_argument("--offload", action=switch, default=False, help="ZeRO 1-2: optimizer state and update on the CPU")
    g.add_argument("--recompute", action=switch, default=False, help="activation checkpointing per transformer layer")
    g = p.add_argument_group("checkpoints and logs")
    g.add_argument("--out", default=None, help="checkpoint directory (default: runs/run_NNN, a new one)")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    g.add_argument("--resume", default=None, help="a checkpoint folder, an --out folder (its newest that verifies), "
                   "or auto: --out's newest if it has one, else start fresh (for torchrun --max-restarts)")
    g.add_argument("--allow-config-change", action=switch, default=False,
                   help="--resume with another --data, --seq-len, --global-batch, --seed or learning-rate schedule")
    g.add_argument("--plan", action=switch, default=False, help="print what each rank will hold under these flags, "
                   "and exit")
    g.add_argument("--wandb", action=switch, default=True, help="log to wandb (offline unless you have logged in)")
    g.add_argument("--log-json", default=None, help="write one JSON object per step to this file (default: none)")
    g.add_argument("--log-every", type=int, default=d.log_every, help="print a log line every N steps")
    return p


def parse_args(argv=None) -> TrainConfig:
    """The effective config of a command line (and its --config file), checked; see `resolved`."""
    p = parser()
    args = p.parse_args(argv)
    if args.config:  # the file's values become the defaults: a flag given on the command line still wins
        if os.path.exists(args.config) and not os.path.isfile(args.config):  # a FIFO: reading it would block
            raise ConfigError(f"--config {args.config} is not a regular file: give a TOML file")
        try:
            p.set_defaults(**read_config_file(args.config, p))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        args = p.parse_args(argv)
    cfg = TrainConfig(**vars(args))
    layout = cfg.dp * cfg.tp * cfg.pp * cfg.cp  # --plan: the ranks the flags ask for, none launched
    world = layout if cfg.plan else int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.ranks_per_node is None:  # torchrun's ranks on this node; without torchrun, one node
        cfg.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cfg.validate(world)
    return cfg.resolved()


def effective(cfg: TrainConfig) -> str:
    """The line each run prints first: every setting, in the file syntax --config reads."""
    return "effective config: " + as_toml(asdict(cfg)).replace("\n", ", ")
