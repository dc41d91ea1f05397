"""One place that chooses how gradients are synchronised, and one AdamW.

Chapters 2 and 3 built four wrappers with one protocol (data_parallel.py): plain data parallelism
and ZeRO stages 1, 2 and 3. Which one a run uses is one decision, taken here, so the training
loop, the benchmarks and the course scripts build them alike:

    build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr),
                    zero=cfg.zero, bucket_mb=cfg.bucket_mb, offload=cfg.offload, precision=of_config(cfg))

    zero 0   DataParallel         the optimizer built here, on the whole parameters
    zero 1   ZeroDataParallel     the wrapper builds it on its slices (make_optimizer), stage 1
    zero 2   ZeroDataParallel     stage 2: the gradients sharded too
    zero 3   Zero3DataParallel    the weights too; each layer is a bucket (bucket_mb unused);
                                  `zeropp` (any of qwz, hpz, qgz) hands it ZeRO++'s transport

`precision` (precision.py) is the same choice for all four: bf16-mixed keeps fp32 master weights
in whichever wrapper runs, whole in DataParallel, this rank's slices under ZeRO.

`adamw` holds AdamW's settings once: betas (0.9, 0.95) and eps 1e-8, as GPT-3 and Llama train.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minipar.data_parallel import DataParallel, GradSync
from minipar.mesh import Groups
from minipar.precision import FULL, Precision
from minipar.zero import ZeroDataParallel
from minipar.zero3 import Zero3DataParallel
from minipar.zeropp import ZeroPP

BETAS = (0.9, 0.95)  # a shorter memory for the second moment than Adam's 0.999: steadier large-model runs
EPS = 1e-8


def adamw(param_groups: list[dict], lr: float, **options) -> torch.optim.AdamW:
    """AdamW as minipar trains with it; `options`: torch's own (fused=True on GPUs, say)."""
    return torch.optim.AdamW(param_groups, lr=lr, betas=BETAS, eps=EPS, **options)


def check_zero(zero: int, offload: bool = False, zeropp: tuple[str, ...] = ()) -> None:
    """The ZeRO options that go together, stated once: build_grad_sync and the run's checks (planning's
    Layout.validate) both ask here. ValueError, one line, named by the flags train.py gives them."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {zero}: choose 0, 1, 2 or 3")
    if offload and zero not in (1, 2):
        raise ValueError("--offload needs --zero 1 or 2: it moves ZeRO's optimizer slices to the CPU")
    if zeropp and zero != 3:
        raise ValueError(f"--zeropp {','.join(zeropp)} needs --zero 3: ZeRO++ changes how ZeRO-3 gathers weights "
                         "and reduces gradients")


def build_grad_sync(model: nn.Module, groups: Groups, param_groups: list[dict],
                    make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], *, zero: int = 0,
                    bucket_mb: float = 25.0, offload: bool = False, precision: Precision = FULL,
                    zeropp: tuple[str, ...] = ()) -> GradSync:
    """The gradient-sync wrapper for ZeRO stage `zero` (0: plain data parallelism) around `model`.
    Each parameter's gradient is averaged over the group its Placement names (`groups.reduction`);
    `make_optimizer(param_groups)` builds the optimizer (ZeRO: on the wrapper's slices of them).
    `precision` bf16-mixed (precision.py): `model` comes in fp32; the wrapper keeps fp32 masters
    (ZeRO: its slices) for the optimizer and turns the model's own weights into bf16 copies."""
    check_zero(zero, offload, zeropp)
    if zero == 3:
        transport = ZeroPP.over(groups, zeropp) if zeropp else None  # zeropp.py; None: the plain messages
        return Zero3DataParallel(model, groups, make_optimizer, param_groups, precision=precision, transport=transport)
    if zero:
        return ZeroDataParallel(model, groups, zero, make_optimizer, param_groups, bucket_mb, offload, precision)
    return DataParallel(model, groups, bucket_mb, optimizer=make_optimizer(param_groups), precision=precision)
