"""The reference model: a Llama-style decoder, plain PyTorch, on one device (chapter 0).

    tokens [b, s] -> tok_emb [b, s, d] -> n_layers x ( x + attn(norm(x)) ; x + mlp(norm(x)) )
             attn: q, k, v projections, RoPE on q and k, causal softmax(q k^T / sqrt(hd)) v,
                   grouped-query: n_kv_heads <= n_heads, each kv head serves n_heads/n_kv_heads
             mlp:  w_down( silu(w_gate x) * w_up x )      (SwiGLU)
      -> norm -> lm_head [b, s, V] (tie_embeddings: tok_emb's table) -> cross-entropy, next token

Every parameter is drawn from its own generator seeded by (seed, name) at its full shape, so a shard
of any layout starts from the single-device weights. It knows nothing of parallelism or experts:
parallelize.py swaps modules and the seams `Llama.loss_fn`, `Attention.attend`, `Attention.positions`;
moe.py adds its block to FEED_FORWARD. Read docs/00_one_device.md and docs/10_operating.md, section 4.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn


class ModelError(ValueError):
    """A refusal about the model's shape (its own, or a layout it cannot take): the run names its --model."""


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
    # Llama-3 RoPE scaling ("llama3"): frequencies whose wavelength exceeds original_max_len / low_freq_factor
    # slow down by rope_factor, those shorter than original_max_len / high_freq_factor are kept, the band between
    # is blended. rope_factor 1 is plain RoPE.
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # the LM head reads the embedding table (one [V, d] weight, not two)
    # Experts (chapter 7, moe.py): n_experts > 0 gives every block after the first `dense_layers` a mixture of experts.
    n_experts: int = 0
    top_k: int = 2
    expert_ffn_dim: int = 0
    n_shared_experts: int = 0
    dense_layers: int = 0
    router: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:  # a hand-written config.json
                raise ModelError(f"{name} {getattr(self, name)!r}: a size is a whole number, 1 or more")
        if not all(type(x) in (int, float) and 0 < x < math.inf for x in (self.norm_eps, self.rope_theta)):
            raise ModelError(f"norm_eps {self.norm_eps!r} and rope_theta {self.rope_theta!r} must be numbers above 0")
        if self.dim % self.n_heads:
            raise ModelError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ModelError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ModelError(f"top-k {self.top_k} must be between 1 and the {self.n_experts} experts")

    def feed_forward(self, layer: int) -> str:
        """The kind of feed-forward block layer `layer` has, and its name in the block: "mlp", or "moe"."""
        return "moe" if self.n_experts > 0 and layer >= self.dense_layers else "mlp"

    def num_params(self, active: bool = False) -> int:
        """Parameter count, computed from the shapes (no model is built: works for 8B too).
        active: only those one token uses (k routed experts of E), what its FLOPs scale with."""
        d, kv, fe = self.dim, self.n_kv_heads * self.head_dim, self.expert_ffn_dim
        attn_and_norms = 2 * d * d + 2 * d * kv + 2 * d
        experts = (self.top_k if active else self.n_experts) + self.n_shared_experts
        ffn = {"moe": self.n_experts * d + 3 * d * fe * experts, "mlp": 3 * d * self.ffn_dim}
        layers = sum(attn_and_norms + ffn[self.feed_forward(i)] for i in range(self.n_layers))
        return (1 if self.tie_embeddings else 2) * self.vocab_size * d + layers + d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x (N - input embedding) + 12 x L x d x s (PaLM appendix B, torchtitan).

        6 per parameter (2 forward, 4 backward), N the parameters one token uses (k routed experts of E;
        norms included, as the convention does). The input embedding is a lookup: its [V, d] table is left
        out, unless tied (then it counts once, as the output projection). Attention adds q k^T and its
        weighted sum of v, 2 x 2·s·d per layer forward, x3 with backward: 12·L·d·s, not halved for the
        causal mask. The one figure for MFU (run_log, bench_gpu) and the planner's clock."""
        input_embedding = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return 6 * (self.num_params(active=True) - input_embedding) + 12 * self.n_layers * self.dim * seq_len


# Named sizes. Toy shapes, no real model's: "tiny" for tests, "small" the CPU default, "125m" a GPT-2-small-sized
# Llama for GPU benchmarks. Real models' shapes (their config.json): "1b" Llama-3.2-1B, "8b" Llama-3.1-8B, "70b"
# Llama-3.1-70B, "405b" Llama-3.1-405B (for the planner: never built), all with Llama-3 RoPE scaling.
LLAMA3: dict = dict(vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, rope_factor=8.0)
CONFIGS = {
    "tiny": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=128),
    "small": ModelConfig(),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000,
                        max_seq_len=2048),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, **{**LLAMA3, "rope_factor": 32.0},
                      tie_embeddings=True),
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, **LLAMA3),
    "70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, **LLAMA3),
    "405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, **LLAMA3),
    # Mixtures of experts: toys "tiny-moe" (tests) and "small-moe" (CPU); Mixtral-8x7B's shapes; DeepSeek-MoE-16B's
    # (64 narrow experts, 6 per token, 2 shared, the first layer dense).
    "tiny-moe": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=128,
                            n_experts=4, top_k=2, expert_ffn_dim=32),
    "small-moe": ModelConfig(n_experts=8, top_k=2, expert_ffn_dim=192, n_shared_experts=1),
    "mixtral-8x7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                                max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2, expert_ffn_dim=14336),
    "deepseek-moe-16b": ModelConfig(dim=2048, n_layers=28, n_heads=16, n_kv_heads=16, ffn_dim=10944,
                                    vocab_size=102400, max_seq_len=4096, n_experts=64, top_k=6,
                                    expert_ffn_dim=1408, n_shared_experts=2, dense_layers=1),
}


def get_config(name: str, **overrides) -> ModelConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model '{name}': choose one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


def config_from(settings: dict) -> ModelConfig:
    """The preset settings["model"], with each ModelConfig field that `settings` gives (not None) in
    its place: a run's flags or saved config in, the model it built out. A new field needs no code here."""
    given = {f.name: settings[f.name] for f in fields(ModelConfig) if settings.get(f.name) is not None}
    return get_config(settings["model"], **given)


# Layout-independent initialisation
def init_tensor(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """The full, single-device value of parameter `name`: N(0, std^2) from its own generator, drawn
    in float32 whatever the training dtype, so float32 and float64 runs start alike."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def init_std(name: str, config: ModelConfig) -> float | None:
    """Standard deviation for a parameter by name; None means 'ones' (the norm gains). Projections
    that write into the residual stream (wo, w_down) are scaled by 1/sqrt(2 n_layers) so the
    residual's variance does not grow with depth (GPT-2's rule)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("wo.weight", "w_down.weight", ".w_down")):
        return 0.02 / math.sqrt(2 * config.n_layers)
    return 0.02


@torch.no_grad()
def init_weights(model: nn.Module, config: ModelConfig, seed: int) -> None:
    for name, p in model.named_parameters():
        if p.is_meta:  # a model on paper (planning/estimate.py): shapes only, no values to draw
            continue
        std = init_std(name, config)
        p.copy_(torch.ones(p.shape) if std is None else init_tensor(name, tuple(p.shape), std, seed))


# Layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotation speed of each pair of dimensions, [head_dim/2], float64: theta^(-2i/hd), with
    Llama-3's scaling when rope_factor > 1 (a wavelength is 2 pi / frequency, in tokens)."""
    hd = config.head_dim
    # On the CPU even inside a meta-device block: a model built on paper then given real storage
    # (to_empty: sample.py, eval.py) keeps a real table. --dim's range keeps it small.
    freqs = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device="cpu") / hd)
    if config.rope_factor == 1:
        return freqs
    fits = config.rope_original_max_len * freqs / (2 * math.pi)  # wavelengths in the original context (ModelConfig)
    keep = ((fits - config.rope_low_freq_factor) / (config.rope_high_freq_factor - config.rope_low_freq_factor))
    keep = keep.clamp(0.0, 1.0)
    return keep * freqs + (1 - keep) * freqs / config.rope_factor


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor, dtype) -> tuple:
    """cos and sin of position * frequency (rope_frequencies), [s, head_dim], in float64 then cast.
    Positions are passed in (not assumed to be 0..s-1) so a rank holding a slice of the sequence
    (context parallelism) rotates by the tokens' global positions."""
    freqs = freqs.to(positions.device)
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]  # [s, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, hd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate each (x_i, x_{i+hd/2}) pair by its angle. x: [b, heads, s, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(hd)) v over earlier positions. Grouped-query: each kv head serves
    q's heads / k's heads query heads. q [b, h, s, hd]; k, v [b, h_kv, s, hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = (repeat(t, "b h s d -> b (h g) s d", g=group) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sequence_positions(seq_len: int, device) -> torch.Tensor:
    return torch.arange(seq_len, device=device)


class Attention(nn.Module):
    """q, k, v projections, RoPE, causal attention, output projection. The number of heads is read
    off the projections' shapes, so a tensor-parallel rank holding some heads runs the same code."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hd, self.head_dim, self.rope_freqs = config.head_dim, config.head_dim, rope_frequencies(config)
        self.wq = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, config.dim, bias=False)
        self.attend = causal_attention  # a KV cache swaps in attention to the cached tokens too
        self.positions = sequence_positions  # ... and the positions after them

    def forward(self, x):
        q, k, v = (rearrange(w(x), "b s (h d) -> b h s d", d=self.head_dim) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_cos_sin(self.positions(x.shape[1], x.device), self.rope_freqs, x.dtype)
        out = self.attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # [b, h, s, hd]
        return self.wo(rearrange(out, "b h s d -> b s (h d)"))


class MLP(nn.Module):
    """SwiGLU: w_down( silu(w_gate x) * w_up x )."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w_up = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w_down = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


# Each kind of feed-forward block (ModelConfig.feed_forward) by name. The model builds what is here and
# knows nothing else: chapter 7 adds its mixture of experts, "moe" (moe.py), when it is imported.
FEED_FORWARD: dict[str, type[nn.Module]] = {"mlp": MLP}


class Block(nn.Module):
    """Attention then the feed-forward block of the kind the config gives this layer, under its name."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.kind = config.feed_forward(layer)
        if self.kind not in FEED_FORWARD:
            raise ValueError(f"layer {layer} takes a {self.kind!r} block, which its module adds to FEED_FORWARD "
                             f"when imported: import minipar.{self.kind}")
        self.add_module(self.kind, FEED_FORWARD[self.kind](config))

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + getattr(self, self.kind)(self.mlp_norm(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, divisor: float | None = None) -> torch.Tensor:
    """Next-token loss over the targets that are not -100, in at least float32: their sum / divisor,
    the one convention of every loss in minipar. The divisor defaults to their count (the mean);
    training divides by the global batch's count instead (run/step.py), so micro-batches add up."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    total = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100, reduction="sum")
    return total / (max(int((targets != -100).sum()), 1) if divisor is None else divisor)  # a number: not saved


class Llama(nn.Module):
    """The decoder on one device. `forward_stage` runs any contiguous part of it, which is all a
    pipeline stage needs (parallelize.py removes the layers a stage does not hold)."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        super().__init__()
        config.validate()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:  # one parameter, named tok_emb.weight; its gradient sums both uses
            self.lm_head.weight = self.tok_emb.weight
        self.loss_fn = cross_entropy  # tensor parallelism swaps in the vocabulary-parallel loss
        init_weights(self, config, seed)

    def forward(self, tokens, targets=None, divisor=None):
        """tokens [b, s] -> logits [b, s, V], or, given targets (the tokens shifted by one; -100 is
        ignored), the next-token loss: the sum of the token losses / divisor (see cross_entropy)."""
        return self.forward_stage(tokens, list(self.layers), first=True, last=True, targets=targets, divisor=divisor)

    def forward_stage(self, x, layer_ids, first: bool, last: bool, targets=None, divisor=None):
        """Run layers `layer_ids` on x: tokens if `first` (embed them), else the activations [b, s, d]
        from the layer before. If `last`, finish with the norm, the LM head and (given targets) the loss."""
        if first:
            x = self.tok_emb(x)
        for i in layer_ids:
            x = self.layers[str(i)](x)
        if not last:
            return x
        logits = self.lm_head(self.norm(x))
        return logits if targets is None else self.loss_fn(logits, targets, divisor)

    def stage_parameters(self, layer_ids, first: bool, last: bool) -> list[nn.Parameter]:
        """The parameters `forward_stage` with these arguments uses."""
        modules = [self.layers[str(i)] for i in layer_ids]
        modules += [self.tok_emb] if first else []
        modules += [self.norm, self.lm_head] if last else []
        return [p for m in modules for p in m.parameters()]
