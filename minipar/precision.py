"""Precision: the dtype each tensor of a run is held in, and the bytes that costs per parameter.

Chapter 3b of the course (mixed precision, beside ZeRO). Three settings, `--precision`:

    fp32           one dtype throughout: weights, gradients, optimizer state, compute (--dtype
                   float64 is this with float64 everywhere: the proofs)
    bf16-autocast  fp32 weights, gradients and optimizer state; torch.autocast runs the matmuls in
                   bf16 on a bf16 copy of each weight that backward keeps
    bf16-mixed     the ZeRO paper's scheme: bf16 working weights and gradients on every rank; the
                   gradient-sync wrapper owns the fp32 masters (ZeRO: its slice) and Adam's moments

`--grad-reduce fp32` (bf16-mixed only) reduces each gradient bucket in fp32, rounding the sum
once. `model_state_bytes` gives the bytes per parameter under each setting and ZeRO stage.
Read docs/03b_mixed_precision.md: the 2 + 2 + 12 bytes, what autocast keeps, the rounding of a
bf16 reduction, and why bf16 and not fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "bf16-autocast", "bf16-mixed")
GRAD_REDUCE = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPES = {"float32": "fp32", "float64": None, "bfloat16": "bf16-autocast"}  # --dtype: the --precision it means


@dataclass(frozen=True)
class Precision:
    """What a run holds and computes in. `built`: the dtype the model is built, loaded and saved in
    (the master weights' dtype); `working`: the weights and gradients the model computes with;
    `reduce`: gradients on the wire; `autocast`: the compute dtype torch.autocast switches to."""

    name: str
    built: torch.dtype = torch.float32
    working: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    autocast: torch.dtype | None = None

    @property
    def mixed(self) -> bool:
        """bf16-mixed: the working weights are a low-precision copy of a master the wrapper owns."""
        return self.working != self.built

    @property
    def activation_width(self) -> int:
        """The bytes of a matmul's output: bf16 under either bf16 setting."""
        return self.autocast.itemsize if self.autocast is not None else self.working.itemsize


FULL = Precision("fp32")


def resolve(precision: str | None, dtype: str | None = None, grad_reduce: str | None = None,
            device_type: str = "cpu") -> Precision:
    """The run's Precision from --precision, --dtype and --grad-reduce; ValueError (one line) for a
    combination that means nothing. How they combine:

        --dtype float64 | float32   one dtype throughout (float32 is --precision fp32); float64
                                    takes no --precision (the proofs run in float64 alone)
        --dtype bfloat16            the older spelling of --precision bf16-autocast
        neither                     fp32 on CPU, bf16-autocast on CUDA (what the benchmarks ran)"""
    if precision not in (None, *PRECISIONS):
        raise ValueError(f"--precision {precision}: choose {', '.join(PRECISIONS)}")
    if dtype not in (None, *DTYPES):
        raise ValueError(f"--dtype {dtype}: choose {', '.join(DTYPES)}")
    implied = DTYPES.get(dtype)
    if dtype and precision and precision != implied:
        raise ValueError(f"--dtype {dtype} with --precision {precision}: "
                         + ("float64 runs everything in float64 (the proofs); drop --precision" if dtype == "float64"
                            else f"--dtype {dtype} means --precision {implied}; give one of them"))
    default = None if dtype == "float64" else "bf16-autocast" if device_type == "cuda" else "fp32"
    name = precision or implied or default
    if grad_reduce is not None and name != "bf16-mixed":
        raise ValueError(f"--grad-reduce {grad_reduce} applies to --precision bf16-mixed only "
                         f"(here the gradients are {dtype or 'float32'} already)")
    if grad_reduce not in (None, *GRAD_REDUCE):
        raise ValueError(f"--grad-reduce {grad_reduce}: choose {' or '.join(GRAD_REDUCE)}")
    if name is None:
        return Precision("float64", torch.float64, torch.float64, torch.float64)
    if name == "bf16-autocast":
        return Precision(name, autocast=torch.bfloat16)
    if name == "bf16-mixed":
        return Precision(name, working=torch.bfloat16, reduce=GRAD_REDUCE[grad_reduce or "bf16"])
    return FULL


def of_config(cfg, device_type: str = "cpu") -> Precision:
    """A TrainConfig's Precision (its --precision, --dtype and --grad-reduce)."""
    return resolve(cfg.precision, cfg.dtype, cfg.grad_reduce, device_type)


def widths(cfg) -> tuple[Precision, int, int]:
    """(cfg's Precision, its working weights' and gradients' bytes, the gradient wire's bytes)."""
    p = of_config(cfg)
    return p, p.working.itemsize, (p.reduce if p.mixed else p.working).itemsize


def model_state_bytes(psi: int, n: int, stage: int, p: Precision) -> dict[str, float]:
    """The table above: bytes per rank of weights, gradients and master + moments for `psi`
    parameters over `n` ranks at ZeRO stage `stage` (0: data parallelism), before padding. ZeRO-3
    in one dtype holds no weights beside its slice: the slice it updates is the one it gathers."""
    width, master = p.working.itemsize, torch.promote_types(p.built, torch.float32).itemsize
    weights = psi * width if stage < 3 else psi * width / n if p.mixed else 0
    states = (master if (p.mixed or stage) else 0) + 2 * master  # the master (if apart from the weights), m, v
    return {"weights": weights, "grads": psi * width / (n if stage >= 2 else 1),
            "master + moments": psi * states / (n if stage >= 1 else 1)}
