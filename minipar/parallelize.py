"""parallelize: the one place where parallelism is applied to the plain model.

model.py is a single-device Llama that knows nothing of other ranks. This file turns it into the
part of a parallel model that one rank holds, in five steps, always in this order:

    1. pipeline   keep only this rank's stages: the other layers (and the embedding or the
                  head, if another stage has them) are deleted before anything else is done
                  to them
    2. tensor     swap modules from a plan, name pattern -> Column/Row/VocabParallel layer, each
                  shard cut from the plain layer's own weight (tied embeddings: the head's shard
                  is the embedding's, as both cut the vocabulary into the same blocks); the
                  input of every attention, MLP and LM head enters the parallel region (f)
                  through a forward pre-hook; the loss becomes the vocabulary-parallel one;
                  with sequence parallelism the norms' gradients become partial sums over tp
    3. context    swap each attention's function for ring attention and its positions for this
                  rank's zigzag share; weigh the loss by this rank's share of the tokens
    4. experts    mixture-of-experts blocks: each rank keeps its E/ep experts and tokens reach
                  them by all-to-all (expert_parallel.py); the load-balancing loss pools its
                  sums over the ranks that hold other tokens of the same sequences (cp, sp)
    5. recompute  each transformer layer keeps only its input and redoes its forward in backward

The gradient-sync wrapper (data_parallel.py, zero.py, zero3.py) comes after, around the result.
Initialisation stays exact: the plain model draws every weight at its full shape from (seed,
name), and a shard is cut from it, so every layout starts from the single-device weights.
With every degree 1 the model is returned as it came.
"""

from __future__ import annotations

import fnmatch
from functools import partial

import torch
import torch.utils.checkpoint
from torch import nn

from minipar.collectives import Group
from minipar.context_parallel import global_token_count, ring_attention, zigzag_positions
from minipar.expert_parallel import parallelize_experts
from minipar.model import Llama
from minipar.moe import MoE
from minipar.tensor_parallel import (
    ColumnParallelLinear,
    ReplicatedRowsLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    enter_parallel_region,
    mark,
    shard,
    vocab_parallel_cross_entropy,
)

# How tensor parallelism cuts each module of the plain Llama (fnmatch patterns on module names).
# "kv": column-parallel when tp divides the kv heads, else each rank keeps the one head it needs.
TP_PLAN = {
    "tok_emb": "vocab",
    "layers.*.attn.wq": "column",
    "layers.*.attn.wk": "kv",
    "layers.*.attn.wv": "kv",
    "layers.*.attn.wo": "row",
    "layers.*.mlp.w_gate": "column",
    "layers.*.mlp.w_up": "column",
    "layers.*.mlp.w_down": "row",
    "lm_head": "column",
}
# Modules whose input must be whole on every tp rank: f (copy, or all-gather of the sequence) on entry.
TP_REGIONS = ("layers.*.attn", "layers.*.mlp", "lm_head")
# Norms: replicated; with sequence parallelism each rank normalises different tokens.
NORMS = ("layers.*.attn_norm", "layers.*.mlp_norm", "norm")


def parallelize(model: Llama, mesh, *, sp: bool = False, recompute: bool = False, pipeline=None) -> Llama:
    """This rank's part of `model` under `mesh` (see the module docstring for the order)."""
    stage = (pipeline.my_layers(), pipeline.holds_first(), pipeline.holds_last()) if pipeline else None
    return parallelize_groups(model, tp=mesh.tp_group, cp=mesh.cp_group, sp=sp, stage=stage, recompute=recompute,
                              ep=mesh.groups().ep)


def parallelize_groups(model: Llama, tp: Group | None = None, cp: Group | None = None, sp: bool = False,
                       stage: tuple | None = None, recompute: bool = False, ep: Group | None = None) -> Llama:
    """The same, from the groups themselves (tests build groups by hand). `stage`: (layer ids,
    holds the embedding, holds the head), or None for the whole model."""
    if stage is not None:
        keep_stage(model, *stage)
    if tp is not None and tp.size > 1:
        tensor_parallel(model, tp, sp)
    if cp is not None and cp.size > 1:
        context_parallel(model, cp)
    if model.config.n_experts:
        parallelize_experts(model, ep, tp, cp, sp)
    if recompute:
        recompute_layers(model)
    return model


def parallel_llama(config, seed: int = 0, tp_group: Group | None = None, sequence_parallel: bool = False,
                   layer_ids=None, embed: bool = True, head: bool = True, recompute: bool = False,
                   cp_group: Group | None = None) -> Llama:
    """The plain Llama(config, seed), parallelized: a shorthand for tests and course scripts."""
    stage = None if layer_ids is None and embed and head else (
        list(range(config.n_layers)) if layer_ids is None else list(layer_ids), embed, head)
    return parallelize_groups(Llama(config, seed), tp_group, cp_group, sequence_parallel, stage, recompute)


# ----------------------------------------------------------------------------------------------
# 1. Pipeline: keep this rank's stages
# ----------------------------------------------------------------------------------------------


def keep_stage(model: Llama, layer_ids, embed: bool, head: bool) -> None:
    if model.config.tie_embeddings and embed != head:
        raise ValueError("tied embeddings need the embedding and the LM head on one pipeline stage: use --pp 1")
    keep = {str(i) for i in layer_ids}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if not embed:
        model.tok_emb = None
    if not head:
        model.norm = model.lm_head = None


# ----------------------------------------------------------------------------------------------
# 2. Tensor (and sequence) parallelism
# ----------------------------------------------------------------------------------------------


def tensor_parallel(model: Llama, tp: Group, sp: bool) -> None:
    config = model.config
    for name, module in list(model.named_modules()):
        style = next((s for pattern, s in TP_PLAN.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is not None and module is not None:  # swap it in where the plain layer was
            parent, _, child = name.rpartition(".")
            new = _sharded_layer(module, style, tp, sp, config)
            setattr(model.get_submodule(parent) if parent else model, child, new)
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in TP_REGIONS):
            module.register_forward_pre_hook(partial(_enter_region, group=tp, sp=sp))
        if sp and any(fnmatch.fnmatchcase(name, pattern) for pattern in NORMS):
            mark(module.weight, tuple(module.weight.shape), partial_grad=True)
    model.loss_fn = partial(_vocab_parallel_loss, group=tp, vocab_size=config.vocab_size)
    if config.tie_embeddings and model.lm_head is not None:  # both cut the vocabulary alike: one shard serves both
        model.lm_head.weight = model.tok_emb.weight


def _sharded_layer(plain: nn.Module, style: str, tp: Group, sp: bool, config) -> nn.Module:
    """The tensor-parallel layer for a plain one, holding this rank's shard of its weight."""
    out_features, in_features = plain.weight.shape if style != "vocab" else (None, None)
    if style == "vocab":
        layer = VocabParallelEmbedding(config.vocab_size, config.dim, tp, sp)
    elif style == "column" or (style == "kv" and config.n_kv_heads % tp.size == 0):
        layer = ColumnParallelLinear(in_features, out_features, tp)
    elif style == "kv":  # fewer kv heads than ranks: the whole weight, this rank's head used
        head = tp.rank * config.n_kv_heads // tp.size
        layer = ReplicatedRowsLinear(in_features, out_features, tp, slice(head * config.head_dim,
                                                                          (head + 1) * config.head_dim))
    else:
        layer = RowParallelLinear(in_features, out_features, tp, sequence_parallel=sp)
    layer = layer.to(device=plain.weight.device, dtype=plain.weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(shard(plain.weight.detach(), layer.weight, tp))
    return layer


def _enter_region(module, args, group: Group, sp: bool):
    return (enter_parallel_region(args[0], group, sp), *args[1:])


def _vocab_parallel_loss(logits, targets, divisor=None, *, group: Group, vocab_size: int):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in at least float32
    return vocab_parallel_cross_entropy(logits, targets, group, vocab_size, divisor=divisor)


# ----------------------------------------------------------------------------------------------
# 3. Context parallelism
# ----------------------------------------------------------------------------------------------


def context_parallel(model: Llama, cp: Group) -> None:
    for layer in model.layers.values():
        layer.attn.attend = partial(_ring, group=cp)
        layer.attn.positions = partial(_zigzag, group=cp)
    model.loss_fn = partial(_token_weighted_loss, loss_fn=model.loss_fn, group=cp)


def _ring(q, k, v, group: Group):
    return ring_attention(q, k, v, group, seq_len=q.shape[2] * group.size)


def _zigzag(local_len: int, device, group: Group):
    return zigzag_positions(group.rank, group.size, local_len * group.size, device)


def _token_weighted_loss(logits, targets, divisor=None, *, loss_fn, group: Group):
    """The mean over the whole sequence, not a mean of the cp ranks' means: this rank's mean
    weighed by its share of the tokens, times cp, so that averaging over cp (dp x cp data
    parallelism does) gives the token mean. Training passes a divisor counted over the global
    batch (train.loss_divisor): then the sum / divisor is already right on every rank."""
    if divisor is not None:
        return loss_fn(logits, targets, divisor)
    loss = loss_fn(logits, targets)
    local = (targets != -100).sum()
    return loss * local * group.size / global_token_count(targets, group).clamp(min=1).to(loss.dtype)


# ----------------------------------------------------------------------------------------------
# 4. Recompute
# ----------------------------------------------------------------------------------------------


def recompute_layers(model: Llama) -> None:
    for layer in model.layers.values():
        layer.forward = partial(_recomputed, layer.forward)


def _recomputed(forward, x):
    if not torch.is_grad_enabled():
        return forward(x)
    calls = [0]

    def run(x):  # called again in backward, to rebuild what was not kept: MoE blocks count tokens once
        calls[0] += 1
        MoE.counting = calls[0] == 1
        try:
            return forward(x)
        finally:
            MoE.counting = True
    return torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
