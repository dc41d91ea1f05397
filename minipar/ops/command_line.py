"""train.py's command line: a flag for each setting, as the setting declares it (layout.py's
`setting`, on the fields of Layout and config.py's TrainConfig), grouped as `--help` shows them;
a --config file's values as its defaults (config_file.py); a flag that would change nothing refused.

The shape flags override `--model`'s preset one size at a time; a flag left out is None here and
takes the preset's value in `TrainConfig.resolved`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, fields

from minipar.layout import SHAPE_FLAGS, flag_of
from minipar.ops.args import HelpFormatter, Parser
from minipar.ops.config_file import read_config_file
from minipar.run import checkpoint
from minipar.run.config import ConfigError, TrainConfig, as_toml

# --help's groups, in order (a setting's `group`; "" is none: --config, above them)
GROUPS = {"layout": "layout (dp x tp x pp x cp must equal the number of ranks)", "model": "model",
          "data": "data and validation", "optimisation": "optimisation", "run": "checkpoints and logs"}
KINDS = {"int": int, "float": float, "str": str, "bool": bool}  # a field's type, None aside


def flags_of(defaults) -> argparse.ArgumentParser:
    """Every flag of train.py; `defaults`: the settings (a TrainConfig), their defaults the flags'."""
    p = Parser(prog="train.py", formatter_class=HelpFormatter,
               description="Train a Llama-style model with minipar. Launch with torchrun for more than one rank.")
    groups = {"": p, **{name: p.add_argument_group(title) for name, title in GROUPS.items()}}
    for name, group in groups.items():
        for f in (f for f in fields(defaults) if f.metadata["group"] == name):
            kind = KINDS[str(f.type).split(" | ")[0]]
            # a bool is a switch: --sp and --no-sp (a flag can turn off what --config turned on)
            how = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
            group.add_argument("--" + f.name.replace("_", "-"), default=getattr(defaults, f.name),
                               choices=f.metadata["choices"], help=f.metadata["help"], **how)
    return p


def parser() -> argparse.ArgumentParser:
    """train.py's command line, its defaults this dataclass's (flags.py)."""
    return flags_of(TrainConfig())


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


# What a --config file cannot carry over to another run: its folders and files, and what only asks for a print.
THIS_RUN_ONLY = ("out", "resume", "init_from", "log_json", "config", "plan", "print_config")


def config_file_text(cfg: TrainConfig) -> str:
    """--print-config: the effective config as a --config file that reproduces this run (its own
    folders and files left out: another run writes its own)."""
    return as_toml({k: v for k, v in asdict(cfg).items() if k not in THIS_RUN_ONLY}) + "\n"
