"""The run's configuration: one dataclass, its command line (and `--config run.toml`,
config_file.py), and the checks made before any process group exists.

The model is `--model`'s preset with any shape flag in its place (`--dim 64 --n-layers 2`), its
vocabulary included: `--model 8b` builds the 8B model of the preset, whatever the data. The BPE
trained on `--data` has `--bpe-vocab` tokens (default: the model's vocabulary, at most 4096) and
must fit in the model's; embedding rows beyond it are never used (a `--tokenizer` file, or token
files' ids, must fit too: ops/preflight.py checks them). `parse_args` returns the
effective config, every setting explicit: each run prints it and saves it with each checkpoint.

Every check here (and the layout's own, layout.py's Layout.validate) runs on every rank
*before* torch.distributed starts, so a layout that cannot work is refused with one line instead of
eight ranks waiting forever for each other.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import asdict, dataclass, fields, replace

from minipar.layout import MAX_BATCH, MAX_STEPS, SHAPE_FLAGS, Layout, flag_of, setting
from minipar.model import ModelConfig
from minipar.run import checkpoint, flags
from minipar.run.args import InputError
from minipar.run.config_file import as_toml, read_config_file
from minipar.run.data import DataError, are_token_files, find_files
from minipar.zeropp import parse as parse_zeropp


class ConfigError(InputError):
    """A bad command line; the message says what to change."""


MAX_TIMEOUT = 1e7  # seconds (115 days): a timedelta, and torch's milliseconds, hold it
A_STEP_COUNT = (lambda v: 0 <= v <= MAX_STEPS, "0 or more steps, at most 2**38")  # a setting's range (layout.setting)
BPE_VOCAB = 4096  # the BPE's default size, when the model's vocabulary is larger


def trains_a_bpe(cfg: TrainConfig) -> bool:
    """--bpe-vocab acts with text --data; named at the size it takes anyway, it asks for nothing."""
    return cfg.bpe_vocab == replace(cfg, bpe_vocab=None).bpe_size() or data_kind(cfg.data) != "tokens"


@dataclass
class TrainConfig(Layout):
    """A run: its layout, model and batch (layout.py: what the estimator reads and
    Layout.validate checks), then its data, optimisation, checkpoints and logs; each setting
    declared once (layout.setting: its flag's help, group, choices and when it acts)."""

    error = ConfigError  # Layout.validate's refusals are the command line's

    data: str | None = setting(None, "a text file or folder, or .bin token files (default: the Python standard "
                               "library)", "data")
    bpe_vocab: int | None = setting(None, f"tokens of the BPE trained on --data; it must fit in the model's "
                                    f"vocabulary (default: the model's vocabulary, at most {BPE_VOCAB})", "data",
                                    within=(lambda v: 257 <= v < 2**32, "257 (the 256 bytes and <|endoftext|>) to "
                                            "2**32 - 1"),
                                    acts_with=("a BPE trained on text --data (not .bin token files)", trains_a_bpe))
    tokenizer: str | None = setting(None, "a Hugging Face tokenizer.json (default: a BPE trained on --data)", "data")
    token_dtype: str = setting("uint16", "the ids' type in .bin token files (nanoGPT's format: a bare array; "
                               "default: {default})", "data", choices=["uint16", "uint32"],
                               acts_with=(".bin token files as --data", lambda c: data_kind(c.data) != "text"))
    val_fraction: float = setting(0.0, "hold out this fraction of the documents (files) for validation, chosen by "
                                  "--seed", "data",
                                  within=(lambda v: 0 <= v < 1, "a fraction of the documents, from 0 to below 1"))
    eval_every: int = setting(0, "validation loss every N steps (0: at the end only; needs --val-fraction)", "data",
                              within=A_STEP_COUNT)
    eval_batches: int = setting(4, "global batches of held-out windows per validation (default: {default})", "data",
                                within=(lambda v: 1 <= v <= MAX_BATCH,
                                        f"1 or more global batches, at most {MAX_BATCH}"),
                                acts_with=("--val-fraction above 0", lambda c: c.val_fraction > 0))
    cache_dir: str = setting("~/.cache/minipar", "where tokenised data is kept", "data")
    steps: int = setting(300, "optimizer steps", "optimisation", within=(lambda v: 1 <= v <= MAX_STEPS, "1 or more, "
                         "at most 2**38 (steps x --global-batch counts samples in int64)"))
    lr: float = setting(3e-3, "peak learning rate (AdamW)", "optimisation",
                        within=(lambda v: 0 < v < math.inf, "a learning rate above 0"))
    min_lr_ratio: float = setting(0.1, "cosine floor, as a fraction of --lr", "optimisation",
                                  within=(lambda v: 0 <= v <= 1, "a fraction of --lr from 0 to 1"))
    warmup: int = setting(30, "linear warm-up steps", "optimisation", within=A_STEP_COUNT)
    grad_clip: float = setting(1.0, "max global gradient norm (0: off)", "optimisation",
                               within=(lambda v: 0 <= v < math.inf, "0 (off) or more"))
    max_bad_steps: int = setting(3, "stop after this many consecutive steps with a non-finite loss or gradient "
                                 "(each is skipped)", "optimisation",
                                 within=(lambda v: 1 <= v <= MAX_STEPS, "1 or more, at most 2**38"))
    timeout: float = setting(300.0, "seconds a collective or message may wait (a stopped or dead rank) before the "
                             "run stops", "optimisation", within=(lambda v: 1 <= v <= MAX_TIMEOUT, "the seconds an "
                             f"operation may wait, 1 to {MAX_TIMEOUT:g} (below 1 s a healthy step's collectives time "
                             "out)"))
    seed: int = setting(0, "weights and data order", "optimisation",
                        within=(lambda v: 0 <= v < 2**32, "0 to 2**32 - 1"))
    out: str | None = setting(None, "checkpoint directory (default: runs/run_NNN, a new one)", "run")
    save_every: int = setting(0, "save every N steps (0: only at the end)", "run", within=A_STEP_COUNT)
    save_on_interrupt: bool = setting(True, "Ctrl-C stops every rank after the same step and saves it (default; "
                                      "--no-save-on-interrupt: unsaved); a second Ctrl-C stops at once", "run")
    resume: str | None = setting(None, "a checkpoint folder, an --out folder (its newest that verifies), or auto: "
                                 "--out's newest if it has one, else start fresh (for torchrun --max-restarts)", "run")
    init_from: str | None = setting(None, "start from these weights at step 0 with a fresh optimizer: a checkpoint "
                                    "folder, e.g. one scripts/convert.py import wrote from a Hugging Face model; "
                                    "without --model, the model's preset and shape are the weights'", "model")
    wandb: bool = setting(True, "log to wandb (offline unless you have logged in)", "run")
    log_json: str | None = setting(None, "write one JSON object per step to this file (default: none)", "run")
    log_every: int = setting(10, "print a log line every N steps", "run",
                             within=(lambda v: 1 <= v <= MAX_STEPS, "1 or more steps, at most 2**38"))
    profile_steps: str | None = setting(None, "A:B: torch.profiler over steps A to B (from 1) on every rank, a "
                                        "Chrome trace per rank in --out/traces/steps_A-B (scripts/trace_report.py "
                                        "reads them)", "run")
    allow_config_change: bool = setting(False, "--resume with another --data, --seq-len, --global-batch, --seed or "
                                        "learning-rate schedule (default: off)", "run",
                                        acts_with=("--resume", lambda c: c.resume is not None))
    replica_groups: int = setting(1, "fault tolerance: the run is this many replica groups, each a torchrun job with "
                                  "this layout inside, averaging gradients through torchft; a lost group is dropped "
                                  "and rejoins with a peer's state (needs the torchft package)", "layout")
    replica_group_id: int = setting(0, "which replica group this job is", "layout",
                                    acts_with=("--replica-groups 2 or more", lambda c: c.replica_groups > 1))
    lighthouse: str | None = setting(None, "HOST:PORT of torchft's lighthouse, where the replica groups agree each "
                                     "step on who takes part", "layout",
                                     acts_with=("--replica-groups 2 or more", lambda c: c.replica_groups > 1))
    plan: bool = setting(False, "print what each rank will hold, and exit", "run")
    print_config: bool = setting(False, "print the effective config as a TOML file for --config (this run's "
                                 "folders and files left out), and exit", "run")
    config: str | None = setting(None, "a TOML file of these flags' settings (keys: the flags' names, e.g. "
                                 "global-batch = 16); the flags given here override it", "")

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
        """Every number in its range (each setting's `within`, and those that hang on another), every
        path flag not empty: one line naming the flag."""
        rules = [(f.name, f.metadata["within"]) for f in fields(self) if f.metadata.get("within")]
        rules += [  # (setting, (whether its value is fine, what to give instead)), the ranges that hang on another
            ("seq_len", (lambda v: 1 <= v <= max_seq_len, f"1 to --model {self.model}'s max_seq_len, {max_seq_len}")),
            ("eval_every", (lambda v: self.val_fraction > 0 or v == 0,
                            "0 (at the end) or more steps, with --val-fraction above 0")),
            ("virtual_stages", (lambda v: v == 1 or v > 1 and self.pp > 1, "1, or more with --pp > 1"))]
        for name, (fine, want) in rules:
            value = getattr(self, name)
            if value is not None and not fine(value):
                raise ConfigError(f"--{name.replace('_', '-')} {value}: give {want}")
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
        is a file: ops/preflight.check_files reads its size.)"""
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
    p, d = parser(), TrainConfig()
    acts_with = {f.name: f.metadata["acts_with"] for f in fields(d) if f.metadata["acts_with"]}
    p.set_defaults(model=None, **dict.fromkeys(acts_with))  # None: not named (--model: --init-from's or the default)
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
    # a setting named at its default asks for nothing (the effective config names them all)
    named = {k for k in acts_with if getattr(args, k) not in (None, getattr(d, k))}
    cfg = TrainConfig(**{**vars(args), **{k: getattr(d, k) for k in ("model", *acts_with) if getattr(args, k) is None}})
    layout = cfg.dp * cfg.tp * cfg.pp * cfg.cp  # --plan, --print-config: the ranks the flags ask for, none launched
    world = layout if cfg.plan or cfg.print_config else int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.ranks_per_node is None:  # torchrun's ranks on this node; without torchrun, one node
        cfg.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cfg.validate(world)
    idle = sorted(k for k in named if not acts_with[k][1](cfg))  # a walk of --data only if a setting asks for it
    if idle:
        value = getattr(cfg, idle[0])
        given = flag_of(idle[0], value)  # as given: --muon-lr 0.05, --tp-overlap, --no-muon-nesterov
        raise ConfigError(f"{given} acts only with {acts_with[idle[0]][0]}, which this run has not: it would change "
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
