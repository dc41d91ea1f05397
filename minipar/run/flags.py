"""train.py's command line: a flag for each setting, as the setting declares it (layout.py's
`setting`, on the fields of Layout and config.py's TrainConfig), grouped as `--help` shows them.

The shape flags override `--model`'s preset one size at a time; a flag left out is None here and
takes the preset's value in `TrainConfig.resolved`.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from minipar.run.args import HelpFormatter, Parser

# --help's groups, in order (a setting's `group`; "" is none: --config, above them)
GROUPS = {"layout": "layout (dp x tp x pp x cp must equal the number of ranks)", "model": "model",
          "data": "data and validation", "optimisation": "optimisation", "run": "checkpoints and logs"}
KINDS = {"int": int, "float": float, "str": str, "bool": bool}  # a field's type, None aside


def parser(defaults) -> argparse.ArgumentParser:
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
