"""parallelize: the one place where parallelism is applied to the plain model.

model.py is a single-device Llama that knows nothing of other ranks. `parallelize` turns it into
the part of a parallel model that one rank holds, in five steps, always in this order:

    1. pipeline   keep only this rank's stages: the other layers (and the embedding or the
                  head, if another stage has them) are deleted before anything else is done
                  to them
    2. tensor     the embedding becomes a VocabParallelEmbedding, the LM head a
                  ColumnParallelLinear over the vocabulary and each MLP a ParallelMLP, each
                  shard cut from the plain layer's own weight (tied embeddings: the head's shard
                  is the embedding's, as both cut the vocabulary into the same blocks); the loss
                  becomes the vocabulary-parallel one; with sequence parallelism the norms'
                  gradients become partial sums over tp
    3. context    the loss is weighed by this rank's share of the tokens
                  (with 2 or 3, each attention becomes a ParallelAttention: this rank's heads
                  over its share of the sequence)
    4. experts    mixture-of-experts blocks: each rank keeps its E/ep experts and tokens reach
                  them by all-to-all (expert_parallel.py); the load-balancing loss pools its
                  sums over the ranks that hold other tokens of the same sequences (cp, sp)
    5. recompute  each transformer layer keeps only its input and redoes its forward in backward

Where the messages are sent, read in the forwards: ParallelAttention and ParallelMLP enter the
parallel region once (f) for the layers that read their input (q, k and v; gate and up), so one
all-reduce of that input's gradient in backward, not one per projection; the row-parallel wo and
w_down leave it (g), and so does the embedding; the LM head enters it itself. ParallelAttention
with a cp group runs ring attention (or Ulysses' all-to-alls) on this rank's zigzag positions.

The gradient-sync wrapper (data_parallel.py, zero.py, zero3.py) comes after, around the result.
Initialisation stays exact: the plain model draws every weight at its full shape from (seed,
name), and a shard is cut from it, so every layout starts from the single-device weights.
With every degree 1 the model is returned as it came.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from einops import rearrange
from torch import nn

from minipar.collectives import Group
from minipar.context_parallel import (
    CP_ATTENTION,
    global_token_count,
    ring_attention,
    ulysses_attention,
    zigzag_positions,
)
from minipar.expert_parallel import parallelize_experts
from minipar.model import (
    MLP,
    Attention,
    Llama,
    ModelConfig,
    apply_rope,
    causal_attention,
    rope_cos_sin,
    sequence_positions,
)
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


def parallelize(model: Llama, *, tp: Group | None = None, cp: Group | None = None, ep: Group | None = None,
                sp: bool = False, stage: tuple | None = None, recompute: bool = False,
                cp_attention: str = "ring") -> Llama:
    """This rank's part of `model` (see the module docstring for the steps and their order).
    tp, cp, ep: this rank's groups (None, or a group of one: not split that way). sp: sequence
    parallelism over tp. stage: (layer ids, holds the embedding, holds the head) of this rank's
    pipeline stages, or None for the whole model. cp_attention: "ring" or "ulysses" (context_parallel.py)."""
    tp, cp = (g if g is not None and g.size > 1 else None for g in (tp, cp))
    if stage is not None:
        keep_stage(model, *stage)
    if tp is not None:
        tensor_parallel(model, tp, sp)
    if tp is not None or cp is not None:
        for layer in model.layers.values():
            layer.attn = ParallelAttention(layer.attn, model.config, tp, sp, cp, cp_attention)
    if cp is not None:
        context_parallel(model, cp)
    if model.config.n_experts:
        parallelize_experts(model, ep, tp, cp, sp)
    if recompute:
        recompute_layers(model)
    return model


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
# 2. Tensor (and sequence) parallelism; the attention of this rank (tensor and context)
# ----------------------------------------------------------------------------------------------


def tensor_parallel(model: Llama, tp: Group, sp: bool) -> None:
    config = model.config
    if model.tok_emb is not None:
        model.tok_emb = cut(model.tok_emb, VocabParallelEmbedding(config.vocab_size, config.dim, tp, sp), tp)
    if model.lm_head is not None:  # over the vocabulary; it enters the parallel region itself (f)
        head = ColumnParallelLinear(config.dim, config.vocab_size, tp, sequence_parallel=sp)
        model.lm_head = cut(model.lm_head, head, tp)
        if config.tie_embeddings:  # both cut the vocabulary alike: one shard serves both
            model.lm_head.weight = model.tok_emb.weight
    for layer in model.layers.values():
        if hasattr(layer, "mlp"):  # a mixture of experts is replicated over tp (expert_parallel.py)
            layer.mlp = ParallelMLP(layer.mlp, tp, sp)
    if sp:  # the norms are replicated, but each rank normalises different tokens
        norms = [n for layer in model.layers.values() for n in (layer.attn_norm, layer.mlp_norm)]
        for norm in norms + ([model.norm] if model.norm is not None else []):
            mark(norm.weight, tuple(norm.weight.shape), partial_grad=True)
    model.loss_fn = partial(_vocab_parallel_loss, group=tp, vocab_size=config.vocab_size)


def cut(plain: nn.Module, layer: nn.Module, tp: Group) -> nn.Module:
    """`layer`, a parallel layer, on plain's device and dtype, holding this rank's shard of plain's weight."""
    layer = layer.to(device=plain.weight.device, dtype=plain.weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(shard(plain.weight.detach(), layer.weight, tp))
    return layer


class ParallelMLP(nn.Module):
    """model.MLP on one tp rank: w_gate and w_up column-parallel (ffn/tp features each), w_down
    row-parallel. One f for the two layers that read x; g in w_down."""

    def __init__(self, plain: MLP, tp: Group, sp: bool):
        super().__init__()
        ffn, dim = plain.w_gate.weight.shape
        self.w_gate = cut(plain.w_gate, ColumnParallelLinear(dim, ffn, tp, enter_region=False), tp)
        self.w_up = cut(plain.w_up, ColumnParallelLinear(dim, ffn, tp, enter_region=False), tp)
        self.w_down = cut(plain.w_down, RowParallelLinear(ffn, dim, tp, sequence_parallel=sp), tp)
        self.tp, self.sp = tp, sp

    def forward(self, x):  # [b, s, d], with sp [b, s/tp, d]
        x = enter_parallel_region(x, self.tp, self.sp)  # f: [b, s, d] on every tp rank
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))  # [b, s, ffn/tp] -> w_down sums (g) -> [b, s, d]


class ParallelAttention(nn.Module):
    """model.Attention on one rank: its heads (tp) over its share of the sequence (cp).

    tp: wq, wk, wv column-parallel by whole heads (with fewer kv heads than tp ranks, each rank
    keeps the whole wk and wv and uses the kv head its query heads read), wo row-parallel.
    cp: this rank's tokens are two zigzag chunks of the sequence; the K/V go around the ring, or
    (cp_attention "ulysses") two all-to-alls give this rank all the tokens of h/cp of its heads.
    tp or cp None: not split that way (the plain layers; causal attention on the whole sequence).
    """

    def __init__(self, plain: Attention, config: ModelConfig, tp: Group | None, sp: bool, cp: Group | None,
                 cp_attention: str = "ring"):
        super().__init__()
        self.head_dim, self.rope_freqs, self.tp, self.sp, self.cp = plain.head_dim, plain.rope_freqs, tp, sp, cp
        if cp_attention not in CP_ATTENTION:
            raise ValueError(f"cp_attention {cp_attention!r}: choose one of {', '.join(CP_ATTENTION)}")
        self.cp_attention = cp_attention
        if tp is None:
            self.wq, self.wk, self.wv, self.wo = plain.wq, plain.wk, plain.wv, plain.wo
            return
        dim, q_features = config.dim, config.n_heads * config.head_dim
        self.wq = cut(plain.wq, ColumnParallelLinear(dim, q_features, tp, enter_region=False), tp)
        self.wk = cut(plain.wk, _kv_projection(config, tp), tp)
        self.wv = cut(plain.wv, _kv_projection(config, tp), tp)
        self.wo = cut(plain.wo, RowParallelLinear(q_features, dim, tp, sequence_parallel=sp), tp)

    def forward(self, x):  # [b, s/cp, d], with sp [b, s/(cp tp), d]
        if self.tp is not None:
            x = enter_parallel_region(x, self.tp, self.sp)  # f, once for q, k and v: [b, s/cp, d]
        q = rearrange(self.wq(x), "b s (h d) -> b h s d", d=self.head_dim)  # [b, h/tp, s/cp, hd]
        k = rearrange(self.wk(x), "b s (h d) -> b h s d", d=self.head_dim)  # [b, h_kv/tp (or 1), s/cp, hd]
        v = rearrange(self.wv(x), "b s (h d) -> b h s d", d=self.head_dim)
        local_len = x.shape[1]
        if self.cp is None:
            positions, attend = sequence_positions(local_len, x.device), causal_attention
        else:  # two zigzag chunks of the sequence, RoPE'd at their global positions
            seq_len = local_len * self.cp.size
            positions = zigzag_positions(self.cp.rank, self.cp.size, seq_len, x.device)
            if self.cp_attention == "ulysses":  # all-to-all: all s tokens of h/cp heads, and back
                attend = partial(ulysses_attention, group=self.cp, seq_len=seq_len)
            else:  # every rank's K/V pass by on the cp ring
                attend = partial(ring_attention, group=self.cp, seq_len=seq_len)
        cos, sin = rope_cos_sin(positions, self.rope_freqs, x.dtype)
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # [b, h/tp, s/cp, hd]
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))  # tp: wo sums the heads' parts (g)


def _kv_projection(config: ModelConfig, tp: Group) -> nn.Module:
    """wk or wv for one tp rank: column-parallel when tp divides the kv heads, else the whole
    weight, of which this rank uses the one head its query heads read."""
    features = config.n_kv_heads * config.head_dim
    if config.n_kv_heads % tp.size == 0:
        return ColumnParallelLinear(config.dim, features, tp, enter_region=False)
    head = tp.rank * config.n_kv_heads // tp.size
    return ReplicatedRowsLinear(config.dim, features, tp, slice(head * config.head_dim, (head + 1) * config.head_dim))


def _vocab_parallel_loss(logits, targets, divisor=None, *, group: Group, vocab_size: int):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in at least float32
    return vocab_parallel_cross_entropy(logits, targets, group, vocab_size, divisor=divisor)


# ----------------------------------------------------------------------------------------------
# 3. Context parallelism (the attention: ParallelAttention above)
# ----------------------------------------------------------------------------------------------


def context_parallel(model: Llama, cp: Group) -> None:
    model.loss_fn = partial(_token_weighted_loss, loss_fn=model.loss_fn, group=cp)


def _token_weighted_loss(logits, targets, divisor=None, *, loss_fn, group: Group):
    """The mean over the whole sequence, not a mean of the cp ranks' means: this rank's mean
    weighed by its share of the tokens, times cp, so that averaging over cp (dp x cp data
    parallelism does) gives the token mean. Training passes a divisor counted over the global
    batch (run/step.loss_divisor): then the sum / divisor is already right on every rank."""
    if divisor is not None:
        return loss_fn(logits, targets, divisor)
    loss = loss_fn(logits, targets)
    local = (targets != -100).sum()
    return loss * local * group.size / global_token_count(targets, group).clamp(min=1).to(loss.dtype)


# ----------------------------------------------------------------------------------------------
# 5. Recompute (4, experts: expert_parallel.parallelize_experts)
# ----------------------------------------------------------------------------------------------


def recompute_layers(model: Llama) -> None:
    for layer in model.layers.values():
        layer.forward = partial(_recomputed, layer.forward, layer)


def _recomputed(forward, layer: nn.Module, x):
    if not torch.is_grad_enabled():
        return forward(x)
    return torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False,
                                             context_fn=lambda: (nullcontext(), _replaying(layer)))


@contextmanager
def _replaying(layer: nn.Module):
    """Around a layer's replay in backward, which rebuilds what its forward did not keep: each module's
    `replaying()` that has one (chapter 7's router: the tokens it counted in forward stay counted once)."""
    with ExitStack() as stack:
        for m in layer.modules():
            if hasattr(m, "replaying"):
                stack.enter_context(m.replaying())
        yield
