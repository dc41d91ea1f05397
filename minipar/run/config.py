"""The run's configuration: one dataclass, its command line (and `--config run.toml`,
config_file.py), and the checks made before any process group exists.

The model is `--model`'s preset with any shape flag in its place (`--dim 64 --n-layers 2`), its
vocabulary included: `--model 8b` builds the 8B model of the preset, whatever the data. The BPE
trained on `--data` has `--bpe-vocab` tokens (default: the model's vocabulary, at most 4096) and
must fit in the model's; embedding rows beyond it are never used (a `--tokenizer` file, or token
files' ids, must fit too: preflight.py checks them). `parse_args` returns the
effective config, every setting explicit: each run prints it and saves it with each checkpoint.

Every check here runs on every rank *before* torch.distributed starts, so a layout that cannot
work is refused with one line instead of eight ranks waiting forever for each other.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass, fields, replace

from minipar.context_parallel import check_cp_layout
from minipar.expert_parallel import check_expert_layout
from minipar.mesh import MeshLayout
from minipar.model import ModelConfig, config_from
from minipar.pipeline.executor import stage_layers
from minipar.pipeline.schedules import ScheduleError
from minipar.pipeline.schedules import build as build_schedule
from minipar.pipeline.schedules import placement as schedule_placement
from minipar.precision import resolve as resolve_precision
from minipar.run import checkpoint, flags
from minipar.run.args import InputError
from minipar.run.config_file import as_toml, read_config_file
from minipar.run.flags import ACTS_WITH, BPE_VOCAB, SHAPE_FLAGS
from minipar.tensor_parallel import check_tensor_layout
from minipar.zeropp import check as check_zeropp


class ConfigError(InputError):
    """A bad command line; the message says what to change."""


# The largest value of each shape flag: 60x Llama 3 405B's widths, 8x its depth; beyond, even the
# estimator's model on paper overflows or takes minutes to build.
SHAPE_MAX = {"dim": 2**20, "n_layers": 1024, "n_heads": 2**14, "n_kv_heads": 2**14, "ffn_dim": 2**22,
             "vocab_size": 2**32, "max_seq_len": 2**24}
MAX_BATCH = 2**24  # sequences in one step: far beyond any run, and its indices stay far inside int64
MAX_TIMEOUT = 1e7  # seconds (115 days): a timedelta, and torch's milliseconds, hold it
MAX_STEPS = 2**38  # steps (or a count of them): the samples consumed, steps x global batch, stay in int64


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
    cp_attention: str = "ring"  # ring (K/V blocks round the cp ring) or ulysses (all-to-all to whole heads)
    zero: int = 0  # ZeRO stage over the dp group: 0 (plain data parallelism), 1, 2, 3
    zeropp: str | None = None  # ZeRO++ on ZeRO-3: any of qwz,hpz,qgz (zeropp.py)
    offload: bool = False  # ZeRO 1-2: optimizer state and step on the CPU
    recompute: bool = False  # activation checkpointing per transformer layer
    ranks_per_node: int | None = None  # None: torchrun's LOCAL_WORLD_SIZE, else the world (parse_args fills it in)
    model: str = "small"
    # Shape flags (SHAPE_FLAGS): None takes the preset's value; parse_args fills them in.
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int | None = None
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None  # the LM head shares the embedding table
    aux_loss_coef: float = 0.01  # MoE load-balancing loss weight
    capacity_factor: float = 0.0  # MoE: 0 is dropless
    data: str | None = None
    bpe_vocab: int | None = None  # the BPE trained on --data; None: bpe_size()
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
    dtype: str | None = None  # float64 for proofs; float32; bfloat16 = --precision bf16-autocast
    precision: str | None = None  # fp32 | bf16-autocast | bf16-mixed; None: fp32 on CPU, bf16-autocast on CUDA
    grad_reduce: str | None = None  # bf16-mixed: bf16 (default) or fp32 gradients on the wire
    bucket_mb: float = 25.0
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

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank (gradient accumulation)."""
        return self.global_batch // (self.dp * self.micro_batch)

    def model_config(self) -> ModelConfig:
        """--model's preset with every model setting this config gives (not None) in its place."""
        return config_from(asdict(self))

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
            ("steps", 1 <= self.steps <= MAX_STEPS, "1 or more, at most 2**38 (steps x --global-batch "
             "counts samples in int64)"),
            *((name, 0 <= getattr(self, name) <= MAX_STEPS, "0 or more steps, at most 2**38")
              for name in ("warmup", "save_every", "eval_every")),
            ("seq_len", 1 <= self.seq_len <= max_seq_len, f"1 to --model {self.model}'s max_seq_len, {max_seq_len}"),
            *((dim, getattr(self, dim) >= 1, "1 or more") for dim in ("dp", "tp", "pp", "cp", "ep")),
            ("ranks_per_node", self.ranks_per_node is None or self.ranks_per_node >= 1, "1 or more"),
            ("global_batch", 1 <= self.global_batch <= MAX_BATCH, f"1 to {MAX_BATCH} sequences"),
            ("micro_batch", 1 <= self.micro_batch <= MAX_BATCH, f"1 to {MAX_BATCH} sequences"),
            ("max_bad_steps", 1 <= self.max_bad_steps <= MAX_STEPS, "1 or more, at most 2**38"),
            *((name, getattr(self, name) is None or 1 <= getattr(self, name) <= SHAPE_MAX[name],
               f"1 to {SHAPE_MAX[name]}") for name in SHAPE_FLAGS),
            ("bpe_vocab", self.bpe_vocab is None or 257 <= self.bpe_vocab < 2**32,
             "257 (the 256 bytes and <|endoftext|>) to 2**32 - 1"),
            ("lr", 0 < self.lr < math.inf, "a learning rate above 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "a fraction of --lr from 0 to 1"),
            ("weight_decay", 0 <= self.weight_decay < math.inf, "0 or more"),
            ("grad_clip", 0 <= self.grad_clip < math.inf, "0 (off) or more"),
            ("bucket_mb", 0 < self.bucket_mb < math.inf, "a size above 0"),
            ("aux_loss_coef", 0 <= self.aux_loss_coef < math.inf, "0 or more"),
            ("capacity_factor", 0 <= self.capacity_factor < math.inf, "0 (dropless) or more"),
            ("timeout", 1 <= self.timeout <= MAX_TIMEOUT, f"the seconds an operation may wait, 1 to {MAX_TIMEOUT:g} "
             f"(below 1 s a healthy step's collectives time out)"),
            ("seed", 0 <= self.seed < 2**32, "0 to 2**32 - 1"),
            ("log_every", 1 <= self.log_every <= MAX_STEPS, "1 or more steps, at most 2**38"),
            ("val_fraction", 0 <= self.val_fraction < 1, "a fraction of the documents, from 0 to below 1"),
            ("eval_every", self.val_fraction > 0 or self.eval_every == 0,
             "0 (at the end) or more steps, with --val-fraction above 0"),
            ("eval_batches", 1 <= self.eval_batches <= MAX_BATCH, f"1 or more global batches, at most {MAX_BATCH}"),
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
        """Ranges first, then what the model and data can take, then whether the world has the right size."""
        m = self.model_config()
        self.check_ranges(m.max_seq_len)
        try:
            m.validate()
            check_tensor_layout(m.n_heads, m.n_kv_heads, m.dim, m.ffn_dim, self.tp, self.sp, self.seq_len)
        except ValueError as e:
            raise ConfigError(f"{e} (--model {self.model})") from None
        if self.global_batch % (self.dp * self.micro_batch):
            raise ConfigError(
                f"--global-batch {self.global_batch} is not divisible by --dp {self.dp} x --micro-batch "
                f"{self.micro_batch}: every rank must run whole micro-batches"
            )
        try:
            check_cp_layout(self.seq_len, self.cp, self.cp_attention, m.n_heads, m.n_kv_heads, self.tp)
            check_expert_layout(m.n_experts, m.top_k, self.ep, self.dp * self.cp)
        except ValueError as e:
            raise ConfigError(f"{e} (--model {self.model})" if "expert" in str(e) or "heads" in str(e)
                              else str(e)) from None
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
        self.check_vocab(m)
        if self.pp > 1 and m.tie_embeddings:
            raise ConfigError(f"--pp {self.pp} with tied embeddings (--model {self.model}"
                              f"{' --tie-embeddings' if self.tie_embeddings else ''}): the embedding and the LM "
                              f"head share one weight, and pipeline stages would split them; use --pp 1 or "
                              f"--no-tie-embeddings")
        if self.init_from and self.resume:
            raise ConfigError("--init-from and --resume: choose one (--resume continues a run, --init-from starts one)")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"--zero {self.zero}: choose 0, 1, 2 or 3")
        if self.zero == 3 and self.pp > 1:
            raise ConfigError("--zero 3 with --pp: every micro-batch would gather each layer twice; "
                              "use --zero 1 or 2 with pipeline parallelism")
        if self.zero == 3 and self.recompute:
            raise ConfigError("--zero 3 with --recompute is not supported: choose one")
        if self.offload and self.zero not in (1, 2):
            raise ConfigError("--offload needs --zero 1 or 2: it moves ZeRO's optimizer slices to the CPU")
        try:
            resolve_precision(self.precision, self.dtype, self.grad_reduce)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        layout = MeshLayout(world_size, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp,
                            ranks_per_node=self.ranks_per_node)  # raises LayoutError
        if self.zeropp is not None:
            try:
                check_zeropp(self.zeropp, self.zero, layout, self.cp, m.n_experts)
            except ValueError as e:
                raise ConfigError(str(e)) from None

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


def parser() -> argparse.ArgumentParser:
    """train.py's command line, its defaults this dataclass's (flags.py)."""
    return flags.parser(TrainConfig())


def parse_args(argv=None) -> TrainConfig:
    """The effective config of a command line (and its --config file), checked; see `resolved`."""
    p = parser()
    p.set_defaults(model=None, **dict.fromkeys(ACTS_WITH))  # None: not named (--model: --init-from's or the default)
    args = p.parse_args(argv)
    if args.config:  # the file's values become the defaults: a flag given on the command line still wins
        if os.path.exists(args.config) and not os.path.isfile(args.config):  # a FIFO: reading it would block
            raise ConfigError(f"--config {args.config} is not a regular file: give a TOML file")
        try:
            p.set_defaults(**read_config_file(args.config, p))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        args = p.parse_args(argv)
    saved = checkpoint.saved_model(args.init_from) if args.init_from and not (args.model or args.resume) else None
    if saved is not None:  # the weights state their model, as from_pretrained reads it; a flag given must agree
        preset, model = saved
        args.model = preset
        for name in (*SHAPE_FLAGS, "tie_embeddings"):
            setattr(args, name, getattr(model, name) if getattr(args, name) is None else getattr(args, name))
    d = TrainConfig()  # a setting named at its default asks for nothing (the effective config names them all)
    named = {k for k in ACTS_WITH if getattr(args, k) not in (None, getattr(d, k))}
    cfg = TrainConfig(**{**vars(args), **{k: getattr(d, k) for k in ("model", *ACTS_WITH) if getattr(args, k) is None}})
    layout = cfg.dp * cfg.tp * cfg.pp * cfg.cp  # --plan: the ranks the flags ask for, none launched
    world = layout if cfg.plan else int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.ranks_per_node is None:  # torchrun's ranks on this node; without torchrun, one node
        cfg.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cfg.validate(world)
    moe = cfg.model_config().n_experts > 0
    acting = {"cp_attention": cfg.cp > 1, "schedule": cfg.pp > 1, "zeropp": cfg.dp > 1, "aux_loss_coef": moe,
              "capacity_factor": moe}
    idle = sorted(k for k in named if not acting[k])
    if idle:
        raise ConfigError(f"--{idle[0].replace('_', '-')} {getattr(cfg, idle[0])} acts only with {ACTS_WITH[idle[0]]}, "
                          f"which this run has not: it would change nothing; leave it out")
    return cfg.resolved()


def effective(cfg: TrainConfig) -> str:
    """The line each run prints first: every setting, in the file syntax --config reads."""
    return "effective config: " + as_toml(asdict(cfg)).replace("\n", ", ")
