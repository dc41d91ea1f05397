"""The reference model: a Llama-style decoder, plain PyTorch, on one device.

Chapter 0 of the course: the thing every parallel version must equal.

    tokens [b, s]
      -> tok_emb                                   [b, s, d]
      -> n_layers x ( x + attn(norm(x)) ; x + mlp(norm(x)) )
             attn: q, k, v projections, RoPE on q and k, causal softmax(q k^T / sqrt(hd)) v,
                   grouped-query: n_kv_heads <= n_heads, each kv head serves n_heads/n_kv_heads
             mlp:  w_down( silu(w_gate x) * w_up x )      (SwiGLU)
      -> norm -> lm_head                            [b, s, V]
      -> cross-entropy against the next token

Initialisation does not depend on how the model will be split. Every parameter is drawn from its
own random generator, seeded by (seed, parameter name), at its full single-device shape. A tensor-
parallel shard is then *the slice* of that full tensor, whatever tp is: a sharded run starts from
exactly the weights of the single-device run, which is what lets tests compare them.

The layers are minipar's tensor-parallel ones (tensor_parallel.py). Built with no tp group (a
group of one) they are exactly nn.Linear and nn.Embedding, so this file is the plain single-device
model and, given a tp group, the tensor-parallel one: the same code, proven equal by the tests.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from einops import rearrange, repeat
from torch import nn

from minipar.collectives import Group
from minipar.context_parallel import global_token_count, ring_attention, zigzag_positions
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


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 4096
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (no model is built: works for 8B too)."""
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        per_layer = 2 * d * d + 2 * d * kv + 3 * d * self.ffn_dim + 2 * d
        return 2 * self.vocab_size * d + self.n_layers * per_layer + d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight (forward 2, backward 4) plus the attention
        scores and their weighted sum, 6 * 2 * n_layers * seq_len * dim (the PaLM appendix formula,
        without halving for the causal mask, as is customary for MFU)."""
        return 6 * self.num_params() + 12 * self.n_layers * seq_len * self.dim


# Named sizes: "tiny" for tests, "small" for the CPU default, the rest real shapes for estimates.
CONFIGS = {
    "tiny": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=64),
    "small": ModelConfig(),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000,
                        max_seq_len=2048),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                      max_seq_len=8192, rope_theta=500000.0),
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                      max_seq_len=8192, rope_theta=500000.0),
}


def get_config(name: str, **overrides) -> ModelConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model '{name}': choose one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


# ----------------------------------------------------------------------------------------------
# Layout-independent initialisation
# ----------------------------------------------------------------------------------------------


def init_tensor(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The full, single-device value of parameter `name`: N(0, std^2) from its own generator.

    Drawn in float32 whatever the training dtype, so float32 and float64 runs start alike.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def init_std(name: str, config: ModelConfig) -> float | None:
    """Standard deviation for a parameter by name; None means 'ones' (the norm gains).

    Projections that write into the residual stream (wo, w_down) are scaled by 1/sqrt(2 n_layers)
    so the residual's variance does not grow with depth (GPT-2's rule).
    """
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("wo.weight", "w_down.weight")):
        return 0.02 / math.sqrt(2 * config.n_layers)
    return 0.02


@torch.no_grad()
def init_weights(model: nn.Module, config: ModelConfig, seed: int, tp_group: Group) -> None:
    """Draw each parameter at its full single-device shape; keep this tp rank's shard of it."""
    for name, p in model.named_parameters():
        full_shape = getattr(p, "_tp_full", tuple(p.shape))
        std = init_std(name, config)
        full = torch.ones(full_shape) if std is None else init_tensor(name, full_shape, std, seed)
        p.copy_(shard(full, p, tp_group))


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, partial_grad: bool = False):
        super().__init__()
        self.eps = eps
        # With sequence parallelism each tp rank normalises different tokens: its gradient of
        # the (replicated) gain is a partial sum, all-reduced over tp after backward.
        self.weight = mark(nn.Parameter(torch.ones(dim)), (dim,), partial_grad=partial_grad)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple:
    """cos and sin of position * frequency, [s, head_dim], computed in float64 then cast.

    Positions are passed in (not assumed to be 0..s-1) so a rank holding a slice of the sequence
    (context parallelism) rotates by the tokens' global positions.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]  # [s, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, hd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate each (x_i, x_{i+hd/2}) pair by its angle. x: [b, heads, s, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Heads split across tp: q, k, v column-parallel (whole heads per rank), wo row-parallel."""

    def __init__(self, config: ModelConfig, tp: Group, sequence_parallel: bool, cp: Group):
        super().__init__()
        self.tp, self.sequence_parallel, self.cp = tp, sequence_parallel, cp
        hd = self.head_dim = config.head_dim
        self.local_heads = config.n_heads // tp.size
        self.wq = ColumnParallelLinear(config.dim, config.n_heads * hd, tp)
        if config.n_kv_heads % tp.size == 0:  # each rank holds its own kv heads
            self.local_kv_heads = config.n_kv_heads // tp.size
            self.wk = ColumnParallelLinear(config.dim, config.n_kv_heads * hd, tp)
            self.wv = ColumnParallelLinear(config.dim, config.n_kv_heads * hd, tp)
        else:  # fewer kv heads than ranks: each rank uses the one kv head its query heads read
            self.local_kv_heads = 1
            head = tp.rank * config.n_kv_heads // tp.size
            rows = slice(head * hd, (head + 1) * hd)
            self.wk = ReplicatedRowsLinear(config.dim, config.n_kv_heads * hd, tp, rows)
            self.wv = ReplicatedRowsLinear(config.dim, config.n_kv_heads * hd, tp, rows)
        self.wo = RowParallelLinear(config.n_heads * hd, config.dim, tp, sequence_parallel=sequence_parallel)

    def forward(self, x, cos, sin):
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)  # [b, s, d] on every tp rank
        q = rearrange(self.wq(x), "b s (h d) -> b h s d", d=self.head_dim)  # local heads only
        k = rearrange(self.wk(x), "b s (h d) -> b h s d", d=self.head_dim)
        v = rearrange(self.wv(x), "b s (h d) -> b h s d", d=self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cp.size > 1:  # this rank holds s/cp tokens: the K/V blocks go round the cp ring
            out = ring_attention(q, k, v, self.cp, seq_len=q.shape[2] * self.cp.size)
            return self.wo(rearrange(out, "b h s d -> b s (h d)"))
        # Grouped-query attention: each kv head is shared by n_heads / n_kv_heads query heads.
        group = self.local_heads // self.local_kv_heads
        k = repeat(k, "b h s d -> b (h g) s d", g=group)
        v = repeat(v, "b h s d -> b (h g) s d", g=group)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h/tp, s, hd]
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    """SwiGLU with gate and up column-parallel, down row-parallel: one g per forward."""

    def __init__(self, config: ModelConfig, tp: Group, sequence_parallel: bool):
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.w_gate = ColumnParallelLinear(config.dim, config.ffn_dim, tp)
        self.w_up = ColumnParallelLinear(config.dim, config.ffn_dim, tp)
        self.w_down = RowParallelLinear(config.ffn_dim, config.dim, tp, sequence_parallel=sequence_parallel)

    def forward(self, x):
        x = enter_parallel_region(x, self.tp, self.sequence_parallel)
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))  # [b, s, ffn/tp] inside


class Block(nn.Module):
    def __init__(self, config: ModelConfig, tp: Group, sequence_parallel: bool, cp: Group):
        super().__init__()
        partial = sequence_parallel and tp.size > 1
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, partial)
        self.attn = Attention(config, tp, sequence_parallel, cp)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps, partial)
        self.mlp = MLP(config, tp, sequence_parallel)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """The decoder. `tp_group=None` builds the plain single-device model.

    A pipeline stage builds only part of it: the layers in `layer_ids` (keeping their global
    numbers, so parameter names match the single-device model's), the embedding if `embed`, the
    final norm and LM head if `head`. Memory for parameters then falls as 1/pp.
    """

    def __init__(self, config: ModelConfig, seed: int = 0, tp_group: Group | None = None,
                 sequence_parallel: bool = False, layer_ids=None, embed: bool = True, head: bool = True,
                 recompute: bool = False, cp_group: Group | None = None):
        super().__init__()
        config.validate()
        tp = self.tp_group = tp_group or Group.solo("tp")
        cp = self.cp_group = cp_group or Group.solo("cp")  # context parallel: this rank's share of the sequence
        self.config, self.sequence_parallel = config, sequence_parallel
        # Activation checkpointing: keep only each layer's input; redo its forward during backward.
        self.recompute = recompute
        layer_ids = range(config.n_layers) if layer_ids is None else layer_ids
        self.tok_emb = VocabParallelEmbedding(config.vocab_size, config.dim, tp, sequence_parallel) if embed else None
        self.layers = nn.ModuleDict({str(i): Block(config, tp, sequence_parallel, cp) for i in layer_ids})
        if head:
            self.norm = RMSNorm(config.dim, config.norm_eps, sequence_parallel and tp.size > 1)
            self.lm_head = ColumnParallelLinear(config.dim, config.vocab_size, tp)  # untied, vocab-parallel
        init_weights(self, config, seed, tp)

    def forward(self, tokens, targets=None, positions=None):
        """tokens [b, s] -> this tp rank's logits [b, s, V/tp], or the mean next-token loss.

        targets are the tokens shifted by one (the data pipeline does the shift); -100 is ignored.
        With tp = 1 the logits are the whole [b, s, V]; `tensor_parallel.gather_logits` joins shards.
        """
        return self.forward_stage(tokens, list(self.layers), first=True, last=True, targets=targets,
                                  positions=positions)

    def forward_stage(self, x, layer_ids, first: bool, last: bool, targets=None, positions=None):
        """Run layers `layer_ids` on x: tokens if `first` (embed them), else the previous stage's
        activations [b, s, d] ([b, s/tp, d] with sequence parallelism). If `last`, finish with the
        norm, the LM head and (given targets) the loss."""
        if first:
            local_len = x.shape[1]
            x = self.tok_emb(x)  # [b, s, d], or [b, s/tp, d] with sequence parallelism
        else:
            local_len = x.shape[1] * (self.tp_group.size if self.sequence_parallel else 1)
        if positions is None:  # global positions: with cp, this rank's zigzag share of the sequence
            cp = self.cp_group
            positions = zigzag_positions(cp.rank, cp.size, local_len * cp.size, x.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        cos, sin = cos.to(x.device), sin.to(x.device)
        for i in layer_ids:
            layer = self.layers[str(i)]
            if self.recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        if not last:
            return x
        x = enter_parallel_region(self.norm(x), self.tp_group, self.sequence_parallel)
        logits = self.lm_head(x)  # [b, s, V/tp]: the full vocabulary never sits on one rank
        if targets is None:
            return logits
        # The loss in at least float32, even when the model computes in bfloat16.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = vocab_parallel_cross_entropy(logits, targets, self.tp_group, self.config.vocab_size)
        if self.cp_group.size == 1:
            return loss
        # The mean over the whole sequence, not a mean of the cp ranks' means: weigh this rank's
        # mean by its share of the tokens, times cp so that averaging over cp (dp x cp data
        # parallelism does) gives the token mean.
        local = (targets != -100).sum()
        return loss * local * self.cp_group.size / global_token_count(targets, self.cp_group).to(loss.dtype)
