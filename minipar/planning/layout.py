"""A layout on paper: how a run cuts its model, its batch and its numbers over the ranks.

Chapter 8 of the course. The estimator (estimate.py) and the planner (planner.py) read a layout, never
the run: the parallel degrees, ZeRO, recompute, the model (--model's preset and the shape settings that
override it), the batch and the precision. `validate` refuses, in one line, a layout that cannot work,
before anything is built, by asking each module's check: the planner asks it of every layout it weighs,
and the run's configuration (run/config.TrainConfig: a Layout and the run's other settings) of every run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

from minipar.collectives import Group, Ledger
from minipar.context_parallel import check_cp_layout
from minipar.expert_parallel import check_expert_layout
from minipar.mesh import MeshLayout, check_counts
from minipar.model import ModelConfig, ModelError, config_from
from minipar.parallelize import check_parallelize, check_zero
from minipar.pipeline.executor import check_pipeline
from minipar.pipeline.schedules import ScheduleError
from minipar.precision import resolve as resolve_precision
from minipar.tensor_parallel import check_tensor_layout
from minipar.zeropp import check as check_zeropp
from minipar.zeropp import parse as parse_zeropp


@dataclass
class Layout:
    """A run's parallel layout, its model, batch and precision; `validate` refuses one that cannot work."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism, carved out of dp x cp (mixture-of-experts models)
    sp: bool = False  # Megatron sequence parallelism inside the tp group
    tp_overlap: bool = False  # tp regions send f's backward message while computing weight gradients
    schedule: str = "1f1b"  # pipeline schedule, used when pp > 1
    virtual_stages: int = 1
    pp_layers: str | None = None  # layers per pipeline stage, "3,1" (--pp-layers); None: balanced
    cp_attention: str = "ring"  # ring (K/V blocks round the cp ring) or ulysses (all-to-all to whole heads)
    zero: int = 0  # ZeRO stage over the dp group: 0 (plain data parallelism), 1, 2, 3
    zeropp: str | None = None  # ZeRO++ on ZeRO-3: any of qwz,hpz,qgz (zeropp.py)
    offload: bool = False  # ZeRO 1-2: optimizer state and step on the CPU
    recompute: bool = False  # activation checkpointing per transformer layer
    recompute_mlp: bool = False  # selective: only each layer's feed-forward block (MLP or MoE) is redone
    ranks_per_node: int | None = None  # None: torchrun's LOCAL_WORLD_SIZE, else the world (parse_args fills it in)
    model: str = "small"
    # The model's shape (run/config's SHAPE_FLAGS): None takes the preset's value; parse_args fills them in.
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
    seq_len: int = 128
    global_batch: int = 16
    micro_batch: int = 8
    weight_decay: float = 0.1
    dtype: str | None = None  # float64 for proofs; float32; bfloat16 = --precision bf16-autocast
    precision: str | None = None  # fp32 | bf16-autocast | bf16-mixed; None: fp32 on CPU, bf16-autocast on CUDA
    grad_reduce: str | None = None  # bf16-mixed: bf16 (default) or fp32 gradients on the wire
    bucket_mb: float = 25.0

    error: ClassVar[type[ValueError]] = ValueError  # what validate raises (TrainConfig: ConfigError)

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank (gradient accumulation)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def stage_counts(self) -> tuple[int, ...] | None:
        """--pp-layers as numbers: the layers of each pipeline stage, or None (balanced)."""
        if self.pp_layers is None:
            return None
        try:
            return tuple(int(n) for n in self.pp_layers.split(","))
        except ValueError:
            raise ValueError(f"--pp-layers {self.pp_layers}: give whole numbers separated by commas, "
                             "one per pipeline stage, e.g. 3,1") from None

    def model_config(self) -> ModelConfig:
        """--model's preset with every model setting this config gives (not None) in its place."""
        return config_from(asdict(self))

    def validate(self, world_size: int) -> None:
        """Asks each chapter what it takes (each rule is stated once, in its module), in the course's order, then
        the world's size. Here only the phrasing: a refusal of the model's shape (ModelError) names --model."""
        m = self.model_config()
        try:
            check_counts(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, ranks_per_node=self.ranks_per_node)
            m.validate()
            check_tensor_layout(m.n_heads, m.n_kv_heads, m.dim, m.ffn_dim, self.tp, self.sp, self.seq_len, self.cp)
            if self.global_batch % (self.dp * self.micro_batch):  # the layout's own rule: accum_steps
                raise ValueError(f"--global-batch {self.global_batch} is not divisible by --dp {self.dp} x "
                                 f"--micro-batch {self.micro_batch}: every rank must run whole micro-batches")
            check_cp_layout(self.seq_len, self.cp, self.cp_attention, m.n_heads, m.n_kv_heads, self.tp)
            check_expert_layout(m.n_experts, self.ep, self.dp * self.cp)
            check_pipeline(self.schedule, self.pp, self.accum_steps, self.virtual_stages, m.n_layers, self.stage_counts)
            check_parallelize(m.tie_embeddings, self.pp > 1, self.recompute, self.recompute_mlp)
            zeropp = parse_zeropp(self.zeropp) if self.zeropp is not None else ()
            check_zero(self.zero, self.offload, zeropp, self.pp)
            resolve_precision(self.precision, self.dtype, self.grad_reduce)
            mesh = MeshLayout(world_size, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp,
                              ranks_per_node=self.ranks_per_node)  # the world's size
            check_zeropp(zeropp, mesh, self.cp, m.n_experts)
        except ModelError as e:
            raise self.error(f"{e} (--model {self.model})") from None
        except ScheduleError as e:  # m is no flag: name those that make it
            raise self.error(f"{e} (micro-batches per step = --global-batch / (--dp x --micro-batch) = "
                             f"{self.accum_steps})") from None
        except ValueError as e:
            raise self.error(str(e)) from None


@dataclass
class PaperGroup(Group):
    """A group with a size and this rank's place in it, and no processes: enough to cut a model on paper."""

    index: int = 0
    ledger: Ledger = field(default_factory=Ledger)

    @property
    def rank(self) -> int:
        return self.index


def paper_group(name: str, size: int, index: int = 0) -> PaperGroup:
    return PaperGroup(name, None, list(range(size)), index=index)
