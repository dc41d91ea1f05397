"""parallelize: the one place where parallelism is applied to the plain model (chapter 10, section 4).

model.py is a single-device Llama. `parallelize` cuts the part of it one rank holds, in this order:
1. pipeline (this rank's stages; chapter 6), 2. tensor (ParallelAttention, ParallelMLP, the vocabulary-
parallel ends: tensor_parallel.py, chapter 4), 3. context (zigzag positions, ring or Ulysses: chapter 5),
4. experts (E/ep each, all-to-all: chapter 7), 5. recompute (whole layers; or selective: the matmuls'
outputs kept, the cheap ops redone; or the MLPs, the contrast: chapter 11). With every degree 1 the
model comes back as it came. `build_grad_sync` then chooses the wrapper that syncs gradients (DataParallel,
ZeroDataParallel or Zero3DataParallel with ZeRO++: chapters 2-3, with the precision policy of 3b);
`adamw` holds AdamW's settings once, `optimizer_of` --optimizer's (Muon: chapter 4c).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from minipar.collectives import Group
from minipar.context_parallel import global_token_count, install_context_parallel
from minipar.data_parallel import DataParallel, GradSync, param_groups
from minipar.expert_parallel import parallelize_experts
from minipar.mesh import Groups
from minipar.model import Llama, ModelError
from minipar.muon import Muon, muon_param_groups
from minipar.precision import FULL, Precision
from minipar.tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    VocabParallelEmbedding,
    cut,
    mark,
    project_after_f,
    project_overlapped,
    vocab_parallel_cross_entropy,
)
from minipar.zero import ZeroDataParallel
from minipar.zero3 import Zero3DataParallel
from minipar.zeropp import ZeroPP


def parallelize(model: Llama, *, tp: Group | None = None, cp: Group | None = None, ep: Group | None = None,
                sp: bool = False, stage: tuple | None = None, recompute: bool = False,
                cp_attention: str = "ring", tp_overlap: bool = False, recompute_mlp: bool = False,
                recompute_selective: bool = False) -> Llama:
    """This rank's part of `model` (see the module docstring for the steps and their order).
    tp, cp, ep: this rank's groups (None, or a group of one: not split that way). sp: sequence
    parallelism over tp. stage: (layer ids, holds the embedding, holds the head) of this rank's
    pipeline stages, or None for the whole model. cp_attention: "ring" or "ulysses" (context_parallel.py).
    tp_overlap: each region's column layers send f's message while computing their weight gradients."""
    check_parallelize(model.config.tie_embeddings, stage is not None and stage[1] != stage[2], recompute, recompute_mlp,
                      recompute_selective, model.config.n_experts)
    tp, cp = (g if g is not None and g.size > 1 else None for g in (tp, cp))
    project = project_overlapped if tp_overlap else project_after_f  # chosen here, once, for every region
    if stage is not None:
        keep_stage(model, *stage)
    if tp is not None:
        tensor_parallel(model, tp, sp, project)
    if cp is not None:  # each attention over this rank's share of the sequence; the loss weighed by that share
        for layer in model.layers.values():
            install_context_parallel(layer.attn, cp, cp_attention)
        model.loss_fn = partial(_token_weighted_loss, loss_fn=model.loss_fn, group=cp)
    if model.config.n_experts:
        parallelize_experts(model, ep, tp, cp, sp)
    if recompute or recompute_selective:  # selective: a layer's matmuls' and attention's outputs kept
        recompute_layers(model, keep_expensive if recompute_selective else None)
    if recompute_mlp:
        recompute_mlps(model)
    return model


def check_parallelize(tied: bool, split: bool, recompute: bool = False, recompute_mlp: bool = False,
                      selective: bool = False, experts: int = 0) -> None:
    """parallelize's options that go together (Layout.validate asks too). split: embedding and head on two stages."""
    if tied and split:
        raise ModelError("tied embeddings with --pp above 1: the embedding and the LM head share one weight, which "
                         "pipeline stages would split; use --pp 1 or --no-tie-embeddings")
    if recompute + recompute_mlp + selective > 1:
        raise ValueError("--recompute, --recompute-selective, --recompute-mlp: each chooses what backward redoes; "
                         "give one")
    if selective and experts:  # the experts are nodes of their own: not op by op
        raise ValueError("--recompute-selective is built for dense layers; use --recompute or --recompute-mlp")


# 1. Pipeline: keep this rank's stages
def keep_stage(model: Llama, layer_ids, embed: bool, head: bool) -> None:
    keep = {str(i) for i in layer_ids}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if not embed:
        model.tok_emb = None
    if not head:
        model.norm = model.lm_head = None


# 2. Tensor (and sequence) parallelism (ParallelAttention, ParallelMLP: tensor_parallel.py)
def tensor_parallel(model: Llama, tp: Group, sp: bool, project=project_after_f) -> None:
    config = model.config
    if model.tok_emb is not None:
        model.tok_emb = cut(model.tok_emb, VocabParallelEmbedding(config.vocab_size, config.dim, tp, sp), tp)
    if model.lm_head is not None:  # over the vocabulary; it enters the parallel region itself (f)
        head = ColumnParallelLinear(config.dim, config.vocab_size, tp, sequence_parallel=sp, project=project)
        model.lm_head = cut(model.lm_head, head, tp)
        if config.tie_embeddings:  # both cut the vocabulary alike: one shard serves both
            model.lm_head.weight = model.tok_emb.weight
    for layer in model.layers.values():
        layer.attn = ParallelAttention(layer.attn, config, tp, sp, project)
        if hasattr(layer, "mlp"):  # a mixture of experts is replicated over tp (expert_parallel.py)
            layer.mlp = ParallelMLP(layer.mlp, tp, sp, project)
    if sp:  # the norms are replicated, but each rank normalises different tokens
        norms = [n for layer in model.layers.values() for n in (layer.attn_norm, layer.mlp_norm)]
        for norm in norms + ([model.norm] if model.norm is not None else []):
            mark(norm.weight, tuple(norm.weight.shape), partial_grad=True)
    model.loss_fn = partial(_vocab_parallel_loss, group=tp, vocab_size=config.vocab_size)


def _vocab_parallel_loss(logits, targets, divisor=None, *, group: Group, vocab_size: int):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in at least float32
    return vocab_parallel_cross_entropy(logits, targets, group, vocab_size, divisor=divisor)


# 3. Context parallelism (ring and Ulysses attention: context_parallel.install_context_parallel)
def _token_weighted_loss(logits, targets, divisor=None, *, loss_fn, group: Group):
    """This rank's sum of token losses / divisor, as on one device. Training passes a divisor counted
    over the global batch (run/step.loss_divisor). Called alone, the model's loss is the whole
    sequence's mean, not a mean of the cp ranks' means: divisor = the real targets of all cp ranks / cp,
    as averaging over cp (dp x cp data parallelism does) divides by cp again."""
    if divisor is None:
        divisor = float(global_token_count(targets, group).clamp(min=1)) / group.size
    return loss_fn(logits, targets, divisor)


# 5. Recompute (4, experts: expert_parallel.parallelize_experts)
def recompute_layers(model: Llama, policy=None) -> None:
    """Each layer keeps its input and, given a policy (keep_expensive), the outputs of the ops it keeps."""
    for layer in model.layers.values():
        layer.forward = partial(_recomputed, layer.forward, layer, policy=policy)


def recompute_mlps(model: Llama) -> None:
    """The contrast (chapter 11): each layer's feed-forward block, the MLP or the MoE block (whose router
    counts its tokens once, through `replaying`), keeps its input and is replayed in backward. It redoes
    the most expensive part of a layer to save a part of its memory."""
    for layer in model.layers.values():
        block = getattr(layer, layer.kind)
        block.forward = partial(_recomputed, block.forward, block)


# Selective recompute as Korthikanti et al. (2022, section 5) and torchtitan's op-level mode choose it:
# keep what is expensive to redo, redo what is cheap and large. Each layer keeps its input and the
# outputs of these ops (the projections, attention's output and log-sum-exp); backward's replay redoes
# the rest: norms, RoPE, SiLU, products, K/V's repeat, the messages that feed a matmul its input.
KEPT_OPS = {getattr(torch.ops.aten, op).default for op in ("mm", "addmm", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention")}


def keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _recomputed(forward, layer: nn.Module, x, policy=None):
    if not torch.is_grad_enabled():
        return forward(x)

    def contexts():  # made afresh for each call: the kept outputs live in the pair's storage
        keeping, replay = create_selective_checkpoint_contexts(policy) if policy else (nullcontext(), nullcontext())
        return keeping, _replaying(layer, replay)
    return torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False, context_fn=contexts)


@contextmanager
def _replaying(layer: nn.Module, replay):
    """Around a layer's replay in backward, which rebuilds what its forward did not keep: the policy's
    replay, and each module's `replaying()` (chapter 7's router: its tokens stay counted once)."""
    with ExitStack() as stack:
        stack.enter_context(replay)
        for m in layer.modules():
            if hasattr(m, "replaying"):
                stack.enter_context(m.replaying())
        yield


# The gradient-sync wrapper around the parallel model, and the one AdamW
BETAS = (0.9, 0.95)  # a shorter memory for the second moment than Adam's 0.999: steadier large-model runs
EPS = 1e-8


def adamw(param_groups: list[dict], lr: float, **options) -> torch.optim.AdamW:
    """AdamW as minipar trains with it; `options`: torch's own (fused=True on GPUs, say)."""
    return torch.optim.AdamW(param_groups, lr=lr, betas=BETAS, eps=EPS, **options)


def optimizer_of(model: nn.Module, cfg, groups: Groups) -> tuple[list[dict], Callable]:
    """--optimizer's param groups for `model` and the function that builds it on them (build_grad_sync's
    make_optimizer): AdamW; or Muon on the blocks' matrices with AdamW on the rest (muon.py, chapter 4c)."""
    if cfg.optimizer == "muon":
        return (muon_param_groups(model, cfg, param_groups(model, cfg)),
                partial(Muon, lr=cfg.lr, groups=groups, betas=BETAS, eps=EPS))
    return param_groups(model, cfg), partial(adamw, lr=cfg.lr)


def check_zero(zero: int, offload: bool = False, zeropp: tuple[str, ...] = (), pp: int = 1) -> None:
    """The ZeRO options that go together: build_grad_sync and Layout.validate ask here. ValueError, one line."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {zero}: choose 0, 1, 2 or 3")
    if offload and zero not in (1, 2):
        raise ValueError("--offload needs --zero 1 or 2: it moves ZeRO's optimizer slices to the CPU")
    if zeropp and zero != 3:
        raise ValueError(f"--zeropp {','.join(zeropp)} needs --zero 3: ZeRO++ changes how ZeRO-3 gathers weights "
                         "and reduces gradients")
    if zero == 3 and pp > 1:
        raise ValueError("--zero 3 with --pp: every micro-batch would gather each layer twice; use --zero 1 or 2 "
                         "with pipeline parallelism")


def build_grad_sync(model: nn.Module, groups: Groups, param_groups: list[dict],
                    make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], *, zero: int = 0,
                    bucket_mb: float = 25.0, offload: bool = False, precision: Precision = FULL,
                    zeropp: tuple[str, ...] = ()) -> GradSync:
    """The gradient-sync wrapper for ZeRO stage `zero` (0: plain data parallelism) around `model`,
    averaging each gradient over the group its Placement names; `make_optimizer(param_groups)` builds
    the optimizer (ZeRO: on the wrapper's slices). bf16-mixed: `model` comes in fp32, the wrapper
    keeps fp32 masters (ZeRO: its slices) and turns the model's own weights into bf16 copies."""
    check_zero(zero, offload, zeropp)
    if zero == 3:
        transport = ZeroPP.over(groups, zeropp) if zeropp else None  # zeropp.py; None: the plain messages
        return Zero3DataParallel(model, groups, make_optimizer, param_groups, precision=precision, transport=transport)
    if zero:
        return ZeroDataParallel(model, groups, zero, make_optimizer, param_groups, bucket_mb, offload, precision)
    return DataParallel(model, groups, bucket_mb, optimizer=make_optimizer(param_groups), precision=precision)
