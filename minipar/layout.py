"""A layout on paper: how a run cuts its model, its batch and its numbers over the ranks.

Chapter 8 of the course. The estimator (estimate.py) and the planner (planner.py) read a layout, never
the run: the parallel degrees, ZeRO, recompute, the model (--model's preset and the shape settings that
override it), the batch and the precision. `validate` refuses, in one line, a layout that cannot work,
before anything is built, by asking each module's check: the planner asks it of every layout it weighs,
and the run's configuration (run/config.TrainConfig: a Layout and the run's other settings) of every run.
Each setting is declared once, as a field (`setting`): its flag, help, choices and when it acts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from minipar.collectives import Group, Ledger
from minipar.context_parallel import CP_ATTENTION, check_cp_layout
from minipar.expert_parallel import check_expert_layout
from minipar.mesh import MeshLayout, check_counts
from minipar.model import CONFIGS, ModelConfig, ModelError, config_from
from minipar.muon import ADJUST_LR, MUON_METHODS, OPTIMIZERS
from minipar.parallelize import check_parallelize, check_zero
from minipar.pipeline.executor import check_pipeline
from minipar.pipeline.schedules import SCHEDULES, ScheduleError
from minipar.precision import DTYPES, GRAD_REDUCE, PRECISIONS
from minipar.precision import resolve as resolve_precision
from minipar.tensor_parallel import check_tensor_layout
from minipar.zeropp import check as check_zeropp
from minipar.zeropp import parse as parse_zeropp

# The bounds past which a number is a mistake: far beyond any run, and its counts stay inside int64.
MAX_BATCH = 2**24  # sequences in one step
MAX_STEPS = 2**38  # steps (or a count of them): the samples consumed, steps x global batch


def setting(default, help: str, group: str, *, choices=None, within=None, acts_with=None, plan=None,
            shape=False) -> Any:
    """A setting, declared once: a dataclass field whose metadata all that reads the setting takes.
        help, group  its train.py flag's --help and section (ops/command_line.py; "{default}": the default);
                     a bool is a switch (--sp, --no-sp); its --config file key is its name
        choices      the values its flag takes
        within       (test of a value, words): a number's range, refused outside it in the words
                     (run/config.check_ranges); None, a preset's, is never tested
        acts_with    (words, condition of the config): set to anything but its default where the
                     condition is false, it would change nothing, and is refused (ops/command_line.parse_args)
        plan         cut, memory, pipeline or optimizer: the planner chooses it and prints it (Layout.as_flags)
        shape        it overrides the field of its name in --model's preset"""
    meta = {"help": help.format(default=default), "group": group, "choices": choices, "within": within,
            "acts_with": acts_with, "plan": plan, "shape": shape}
    return field(default=default, metadata=meta)


def shape_setting(what: str, most: int) -> Any:
    """A model-shape setting: None takes --model's preset's value. `most`: beyond it (60x Llama 3
    405B's widths, 8x its depth) even the estimator's model on paper overflows or takes minutes."""
    return setting(None, f"{what} (default: the preset's)", "model", shape=True,
                   within=(lambda v: 1 <= v <= most, f"1 to {most}"))


def has_experts(layout: Layout) -> bool:
    return layout.model_config().n_experts > 0


MUON = ("--optimizer muon", lambda c: c.optimizer == "muon")  # what the muon_* settings act with
MUON_ZERO = ("--optimizer muon with --zero 1 or more", lambda c: c.optimizer == "muon" and c.zero > 0)


@dataclass
class Layout:
    """A run's parallel layout, its model, batch and precision; `validate` refuses one that cannot work."""

    dp: int = setting(1, "data-parallel degree", "layout", plan="cut")
    tp: int = setting(1, "tensor-parallel degree", "layout", plan="cut")
    pp: int = setting(1, "pipeline-parallel degree", "layout", plan="cut")
    cp: int = setting(1, "context-parallel degree", "layout", plan="cut")
    ep: int = setting(1, "expert-parallel degree, carved out of dp x cp (MoE models)", "layout")
    sp: bool = setting(False, "sequence parallelism in the norm/residual regions (tp > 1)", "layout", plan="cut")
    tp_overlap: bool = setting(False, "tensor parallelism sends each region's backward message while computing its "
                               "weight gradients (bitwise the same step; with --sp, one more all-gather of the input "
                               "per region: only its shard is kept)", "layout",
                               acts_with=("--tp 2 or more", lambda c: c.tp > 1))
    schedule: str = setting("1f1b", "pipeline schedule ({default})", "layout", choices=SCHEDULES, plan="pipeline",
                            acts_with=("--pp 2 or more", lambda c: c.pp > 1))
    virtual_stages: int = setting(1, "chunks per pipeline rank (interleaved)", "layout", plan="pipeline")
    pp_layers: str | None = setting(None, "layers per pipeline stage, e.g. 3,1 (the last stage also carries the LM "
                                    "head and the loss); default: balanced, the extra ones to the first stages",
                                    "layout", acts_with=("--pp 2 or more", lambda c: c.pp > 1))
    cp_attention: str = setting("ring", "context-parallel attention: K/V round a ring, or all-to-alls to whole heads "
                                "(ulysses: heads / tp must divide by cp; default: {default})", "layout",
                                choices=CP_ATTENTION, acts_with=("--cp 2 or more", lambda c: c.cp > 1))
    zero: int = setting(0, "ZeRO stage over the dp group: 0, 1, 2 or 3", "optimisation", plan="memory")
    zeropp: str | None = setting(None, "ZeRO++ on --zero 3: any of qwz,hpz,qgz (int8 forward gather, backward "
                                 "gather inside the node, int4 gradients)", "optimisation",
                                 acts_with=("--dp 2 or more", lambda c: c.dp > 1))
    offload: bool = setting(False, "ZeRO 1-2: optimizer state and update on the CPU", "optimisation")
    recompute: bool = setting(False, "activation checkpointing per transformer layer", "optimisation", plan="memory")
    recompute_selective: bool = setting(False, "selective activation checkpointing: each layer keeps its matmuls' "
                                        "and attention's outputs and redoes the cheap ops (norms, RoPE, SiLU, "
                                        "products) in backward", "optimisation", plan="memory")
    recompute_mlp: bool = setting(False, "the contrast to --recompute-selective: each layer's MLP (or MoE block), the "
                                  "most expensive part to redo, is redone in backward", "optimisation", plan="memory")
    ranks_per_node: int | None = setting(None, "ranks that share a node (its fast links): the ledger counts what "
                                         "crosses between nodes; less than the world simulates several nodes on one "
                                         "machine (default: torchrun's LOCAL_WORLD_SIZE, else every rank on one "
                                         "node)", "layout")
    model: str = setting("small", "named model size: the preset the shape flags below override (default: "
                         "--init-from's, else {default})", "model", choices=list(CONFIGS))
    dim: int | None = shape_setting("hidden size", 2**20)
    n_layers: int | None = shape_setting("transformer blocks", 1024)
    n_heads: int | None = shape_setting("attention heads", 2**14)
    n_kv_heads: int | None = shape_setting("key/value heads (grouped-query attention)", 2**14)
    ffn_dim: int | None = shape_setting("MLP hidden size", 2**22)
    vocab_size: int | None = shape_setting("the model's vocabulary: embedding rows, the tokenizer's must fit", 2**32)
    max_seq_len: int | None = shape_setting("longest sequence the run may use", 2**24)
    tie_embeddings: bool | None = setting(None, "the LM head shares the embedding table (default: the preset's; "
                                          "1b ties)", "model")
    aux_loss_coef: float = setting(0.01, "MoE load-balancing loss weight (default: {default})", "model",
                                   within=(lambda v: 0 <= v < math.inf, "0 or more"),
                                   acts_with=("a model with experts", has_experts))
    capacity_factor: float = setting(0.0, "MoE: tokens an expert takes, x its fair share (default {default}: "
                                     "dropless, every token served)", "model",
                                     within=(lambda v: 0 <= v < math.inf, "0 (dropless) or more"),
                                     acts_with=("a model with experts", has_experts))
    seq_len: int = setting(128, "tokens per sequence", "data")
    global_batch: int = setting(16, "sequences per step, all dp ranks", "optimisation",
                                within=(lambda v: 1 <= v <= MAX_BATCH, f"1 to {MAX_BATCH} sequences"))
    micro_batch: int = setting(8, "sequences per forward on one rank", "optimisation",
                               within=(lambda v: 1 <= v <= MAX_BATCH, f"1 to {MAX_BATCH} sequences"))
    weight_decay: float = setting(0.1, "AdamW's (and Muon's), on matrices only", "optimisation",
                                  within=(lambda v: 0 <= v < math.inf, "0 or more"))
    optimizer: str = setting("adamw", "adamw, or muon: Muon on the matrices inside the blocks, AdamW on the "
                             "embedding, head and norms (default: {default})", "optimisation", choices=OPTIMIZERS,
                             plan="optimizer")
    muon_lr: float = setting(0.02, "Muon's peak learning rate; the schedule scales it as it scales --lr",
                             "optimisation", within=(lambda v: 0 < v < math.inf, "a learning rate above 0"),
                             acts_with=MUON)
    muon_momentum: float = setting(0.95, "Muon's momentum (default: {default})", "optimisation",
                                   within=(lambda v: 0 <= v < 1, "0 to below 1"), acts_with=MUON)
    muon_nesterov: bool = setting(True, "Muon steps along the momentum's look-ahead (Nesterov; default)",
                                  "optimisation", acts_with=MUON)
    muon_ns_steps: int = setting(5, "Newton-Schulz iterations per Muon step (default: {default})", "optimisation",
                                 within=(lambda v: 1 <= v <= 99, "1 to 99 iterations"), acts_with=MUON)
    muon_adjust_lr: str = setting("original", "Muon's lr per matrix shape: original, sqrt(max(1, rows/cols)); "
                                  "match_rms_adamw, 0.2 sqrt(max(rows, cols)) (default: {default})", "optimisation",
                                  choices=ADJUST_LR, acts_with=MUON)
    muon_method: str = setting("gather", "ZeRO's slices and Muon's matrices: gather (every rank gathers each matrix "
                               "its slice cuts), owner (one rank per matrix gathers it and sends the slices back) or "
                               "whole (slices end between matrices: uneven; default: {default})",
                               "optimisation", choices=MUON_METHODS, acts_with=MUON_ZERO, plan="optimizer")
    dtype: str | None = setting(None, "float64: all in float64 (proofs; no --precision); float32 = --precision "
                                "fp32, bfloat16 = bf16-autocast", "optimisation", choices=DTYPES)
    precision: str | None = setting(None, "fp32; bf16-autocast (fp32 weights, bf16 matmuls); bf16-mixed (the ZeRO "
                                    "paper's: bf16 weights and gradients, fp32 master weights and Adam state: 16 "
                                    "bytes per parameter). Default: fp32 on CPU, bf16-autocast on CUDA",
                                    "optimisation", choices=PRECISIONS)
    grad_reduce: str | None = setting(None, "bf16-mixed: gradients summed over ranks in bf16 (default: rounded at "
                                      "each of N-1 adds) or fp32 (twice the bytes; the mean rounded once, within "
                                      "half a bf16 ulp)", "optimisation", choices=GRAD_REDUCE)
    bucket_mb: float = setting(25.0, "data-parallel gradient bucket size", "optimisation",
                               within=(lambda v: 0 < v < math.inf, "a size above 0"))

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

    def as_flags(self, base: Layout | None = None) -> str:
        """The layout as train.py's flags: each setting the planner chooses (cut, memory, pipeline, optimizer)
        that differs from its default or from `base`'s (a layout offered instead of `base`)."""
        base = base or type(self)()
        picks = [f for k in ("cut", "memory", "pipeline", "optimizer") for f in fields(self) if f.metadata["plan"] == k]
        return " ".join(flag_of(f.name, getattr(self, f.name)) for f in picks  # at its default, as in base: unsaid
                        if not getattr(self, f.name) == f.default == getattr(base, f.name))

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
            check_parallelize(m.tie_embeddings, self.pp > 1, self.recompute, self.recompute_mlp,
                              self.recompute_selective, m.n_experts)
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


# The settings that override one field of --model's preset (ModelConfig's field of the same name).
SHAPE_FLAGS = tuple(f.name for f in fields(Layout) if f.metadata["shape"])


def flag_of(name: str, value) -> str:
    """A setting as train.py's flag: --sp, --no-sp, --zero 1."""
    flag = "--" + name.replace("_", "-")
    return (flag if value else f"--no-{flag[2:]}") if isinstance(value, bool) else f"{flag} {value}"


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
