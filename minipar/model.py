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
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn


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
def init_weights(model: nn.Module, config: ModelConfig, seed: int) -> None:
    for name, p in model.named_parameters():
        std = init_std(name, config)
        p.copy_(torch.ones(p.shape) if std is None else init_tensor(name, tuple(p.shape), std, seed))


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple:
    """cos and sin of position * frequency, [s, head_dim], computed in float64 then cast.

    Positions are passed in (not assumed to be 0..s-1) so a rank holding a slice of the sequence
    (context parallelism) rotates by the tokens' global positions.
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]  # [s, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, hd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate each (x_i, x_{i+hd/2}) pair by its angle. x: [b, heads, s, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x, cos, sin):
        q = rearrange(self.wq(x), "b s (h d) -> b h s d", d=self.head_dim)
        k = rearrange(self.wk(x), "b s (h d) -> b h s d", d=self.head_dim)
        v = rearrange(self.wv(x), "b s (h d) -> b h s d", d=self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Grouped-query attention: each kv head is shared by n_heads / n_kv_heads query heads.
        group = self.n_heads // self.n_kv_heads
        k = repeat(k, "b h s d -> b (h g) s d", g=group)
        v = repeat(v, "b h s d -> b (h g) s d", g=group)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, s, hd]
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w_up = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w_down = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 0):
        super().__init__()
        config.validate()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)  # untied
        init_weights(self, config, seed)

    def forward(self, tokens, targets=None, positions=None):
        """tokens [b, s] -> logits [b, s, V], or the mean next-token loss if targets are given.

        targets are the tokens shifted by one (the data pipeline does the shift); -100 is ignored.
        """
        b, s = tokens.shape
        if positions is None:
            positions = torch.arange(s, device=tokens.device)
        x = self.tok_emb(tokens)  # [b, s, d]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        cos, sin = cos.to(x.device), sin.to(x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # [b, s, V]
        if targets is None:
            return logits
        # The loss in at least float32, even when the model computes in bfloat16.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
