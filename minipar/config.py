"""The run's configuration: one dataclass, its command line, and the checks made before any
process group exists.

Every check here runs on every rank *before* torch.distributed starts, so a layout that cannot
work is refused with one line instead of eight ranks waiting forever for each other.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from minipar.context_parallel import check_cp_layout
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

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank (gradient accumulation)."""
        return self.global_batch // (self.dp * self.micro_batch)

    def validate(self, world_size: int) -> None:
        """What the model and data can take first, then whether the world has the right size."""
        m = CONFIGS[self.model]
        try:
            check_tensor_layout(m.n_heads, m.n_kv_heads, m.dim, m.ffn_dim, self.tp, self.sp, self.seq_len)
        except ValueError as e:
            raise ConfigError(f"{e} (--model {self.model})") from None
        for name in ("steps", "seq_len", "global_batch", "micro_batch", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
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
        if not self.timeout > 0:
            raise ConfigError(f"--timeout {self.timeout}: give the seconds an operation may wait, above 0")
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


def parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
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
    g.add_argument("--data", default=None, help="text file or folder (default: the Python standard library)")
    g.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary trained on the data")
    g.add_argument("--cache-dir", default=d.cache_dir, help="where tokenised data is kept")
    g.add_argument("--seq-len", type=int, default=d.seq_len)
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
    g.add_argument("--resume", default=None, help="a checkpoint folder, or an --out folder (its latest)")
    g.add_argument("--no-wandb", dest="wandb", action="store_false", help="do not log to wandb")
    g.add_argument("--log-json", default=None, help="write one JSON object per step to this file")
    g.add_argument("--log-every", type=int, default=d.log_every, help="print a log line every N steps")
    return p


def parse_args(argv=None) -> TrainConfig:
    args = parser().parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items()})
    cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
    return cfg
