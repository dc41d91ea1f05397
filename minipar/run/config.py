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
import re
from dataclasses import asdict, dataclass, fields, replace

from minipar.model import ModelConfig
from minipar.planning.layout import Layout
from minipar.run import checkpoint, flags
from minipar.run.args import InputError
from minipar.run.config_file import as_toml, read_config_file
from minipar.run.data import DataError, are_token_files, find_files
from minipar.run.flags import ACTS_WITH, BPE_VOCAB, SHAPE_FLAGS
from minipar.zeropp import parse as parse_zeropp


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
    save_on_interrupt: bool = True  # Ctrl-C: save where the run stops (saving.py)
    resume: str | None = None
    init_from: str | None = None  # start from these weights (convert.py import, or a checkpoint) at step 0
    wandb: bool = True
    log_json: str | None = None
    log_every: int = 10
    profile_steps: str | None = None  # "A:B": torch.profiler over steps A to B (run/profiling.py)
    allow_config_change: bool = False  # --resume: accept a changed data, batch, seed or learning-rate schedule
    replica_groups: int = 1  # fault-tolerant data parallelism: this many replica groups on torchft (replicas.py)
    replica_group_id: int = 0  # which of them this torchrun job is
    lighthouse: str | None = None  # torchft's lighthouse, host:port, where the groups agree on who takes part
    plan: bool = False  # print what each rank will hold (estimate.py) and exit
    print_config: bool = False  # print the effective config as a --config file, and exit
    config: str | None = None  # the TOML file the settings came from, if any

    def bpe_size(self) -> int:
        """The vocabulary of the BPE trained on --data: --bpe-vocab, else the model's, at most 4096
        (more merges than a small corpus can teach only lengthen training)."""
        return self.bpe_vocab if self.bpe_vocab is not None else min(BPE_VOCAB, self.model_config().vocab_size)

    def resolved(self) -> TrainConfig:
        """The effective config: what the preset and the BPE rule chose, written in (--zeropp as read:
        ' qwz,qwz,' is qwz)."""
        model = self.model_config()
        chosen = {f.name: getattr(model, f.name) for f in fields(ModelConfig)
                  if hasattr(self, f.name) and getattr(self, f.name) is None}
        zeropp = ",".join(parse_zeropp(self.zeropp)) if self.zeropp else None
        return replace(self, **chosen, bpe_vocab=self.bpe_size(), zeropp=zeropp)

    def check_ranges(self, max_seq_len: int) -> None:
        """Every number in its range, every path flag not empty: one line naming the flag."""
        rules = (  # (setting, whether its value is fine, what to give instead)
            ("steps", 1 <= self.steps <= MAX_STEPS, "1 or more, at most 2**38 (steps x --global-batch "
             "counts samples in int64)"),
            *((name, 0 <= getattr(self, name) <= MAX_STEPS, "0 or more steps, at most 2**38")
              for name in ("warmup", "save_every", "eval_every")),
            ("seq_len", 1 <= self.seq_len <= max_seq_len, f"1 to --model {self.model}'s max_seq_len, {max_seq_len}"),
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
        self.profiled()

    def validate(self, world_size: int) -> None:
        """Ranges first, then the layout (Layout.validate), what the data can take, where the weights come from."""
        m = self.model_config()
        self.check_ranges(m.max_seq_len)
        super().validate(world_size)
        self.check_vocab(m)
        self.check_replicas()
        if self.init_from and self.resume:
            raise ConfigError("--init-from and --resume: choose one (--resume continues a run, --init-from starts one)")

    def check_replicas(self) -> None:
        """Replica groups: a seat among them, a lighthouse to meet at, and a batch every group can share."""
        r = self.replica_groups
        if not 1 <= r <= 1024:
            raise ConfigError(f"--replica-groups {r}: give 1 (none) to 1024")
        if not 0 <= self.replica_group_id < r:
            raise ConfigError(f"--replica-group-id {self.replica_group_id}: give 0 to --replica-groups - 1 ({r - 1})")
        if r > 1 and not self.lighthouse:
            raise ConfigError(f"--replica-groups {r} needs --lighthouse HOST:PORT, where torchft's lighthouse runs "
                              "(scripts/train_ft.py starts one)")
        if r > 1:
            lighthouse_address(self.lighthouse)
        if r > 1 and self.global_batch % (r * self.dp * self.micro_batch):
            raise ConfigError(f"--global-batch {self.global_batch} is not divisible by --replica-groups {r} x --dp "
                              f"{self.dp} x --micro-batch {self.micro_batch}: every group's ranks take whole "
                              f"micro-batches of it")

    def profiled(self) -> tuple[int, int] | None:
        """--profile-steps A:B as (A, B), both profiled, or None; steps the run does not reach are refused."""
        if self.profile_steps is None:
            return None
        steps = re.fullmatch(r"([0-9]{1,12}):([0-9]{1,12})", self.profile_steps)
        if steps is None:
            raise ConfigError(f"--profile-steps {self.profile_steps!r}: give the first and last step to profile "
                              f"as A:B, e.g. 2:3")
        first, last = int(steps[1]), int(steps[2])
        if not 1 <= first <= last <= self.steps:
            raise ConfigError(f"--profile-steps {self.profile_steps}: give steps A <= B from 1 to --steps "
                              f"{self.steps} (a step outside the run would profile nothing)")
        return first, last

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


def lighthouse_address(text: str) -> tuple[str, int]:
    """--lighthouse as (host, port): HOST:PORT, or http://HOST:PORT as torchft writes it; the host a
    name, an IPv4 address or an [IPv6] one. Anything else is refused here, before any process group,
    not found by torchft's connect attempt after --timeout."""
    found = re.fullmatch(r"(?:http://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})/?", text)
    if found is None or not 1 <= int(found[2]) <= 65535:
        raise ConfigError(f"--lighthouse {text!r}: give HOST:PORT (e.g. localhost:29510, torchft_lighthouse's "
                          f"default), the port 1 to 65535, at most one http:// before it and no spaces")
    return found[1], int(found[2])


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
        args.model, model = saved  # an imported model's preset: the default (its shape says all)
        vars(args).update({n: getattr(model, n) for n in (*SHAPE_FLAGS, "tie_embeddings") if getattr(args, n) is None})
    d = TrainConfig()  # a setting named at its default asks for nothing (the effective config names them all)
    named = {k for k in ACTS_WITH if getattr(args, k) not in (None, getattr(d, k))}
    cfg = TrainConfig(**{**vars(args), **{k: getattr(d, k) for k in ("model", *ACTS_WITH) if getattr(args, k) is None}})
    layout = cfg.dp * cfg.tp * cfg.pp * cfg.cp  # --plan, --print-config: the ranks the flags ask for, none launched
    world = layout if cfg.plan or cfg.print_config else int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.ranks_per_node is None:  # torchrun's ranks on this node; without torchrun, one node
        cfg.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cfg.validate(world)
    moe = cfg.model_config().n_experts > 0
    if cfg.bpe_vocab == replace(cfg, bpe_vocab=None).bpe_size():  # the BPE's default size (an effective config's)
        named.discard("bpe_vocab")
    kind = data_kind(cfg.data) if {"token_dtype", "bpe_vocab"} & named else None  # a walk of --data: only if asked
    acting = {"tp_overlap": cfg.tp > 1, "cp_attention": cfg.cp > 1, "schedule": cfg.pp > 1, "pp_layers": cfg.pp > 1,
              "zeropp": cfg.dp > 1, "aux_loss_coef": moe, "capacity_factor": moe,
              "replica_group_id": cfg.replica_groups > 1, "lighthouse": cfg.replica_groups > 1,
              "allow_config_change": cfg.resume is not None, "eval_batches": cfg.val_fraction > 0,
              "token_dtype": kind != "text", "bpe_vocab": kind != "tokens"}
    idle = sorted(k for k in named if not acting[k])
    if idle:
        value = getattr(cfg, idle[0])
        given = f"--{idle[0].replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")  # a switch: named
        raise ConfigError(f"{given} acts only with {ACTS_WITH[idle[0]]}, which this run has not: it would change "
                          f"nothing; leave it out")
    return cfg.resolved()


def data_kind(data: str | None) -> str | None:
    """--data's kind: "tokens" (.bin token files) or "text"; None where it cannot be read here (then
    launch.check_paths says why, on each node that cannot: a node's files are its own)."""
    try:
        return "tokens" if are_token_files(data, find_files(data)) else "text"
    except DataError:
        return None


# What a --config file cannot carry over to another run: its folders and files, and what only asks for a print.
THIS_RUN_ONLY = ("out", "resume", "init_from", "log_json", "config", "plan", "print_config")


def config_file_text(cfg: TrainConfig) -> str:
    """--print-config: the effective config as a --config file that reproduces this run (its own
    folders and files left out: another run writes its own)."""
    return as_toml({k: v for k, v in asdict(cfg).items() if k not in THIS_RUN_ONLY}) + "\n"


def effective(cfg: TrainConfig) -> str:
    """The line each run prints first: every setting, in the file syntax --config reads."""
    return "effective config: " + as_toml(asdict(cfg)).replace("\n", ", ")
