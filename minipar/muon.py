"""Muon: an optimizer whose update of a weight needs the whole matrix, in every layout.

Chapter 4c of the course (docs/04c_muon.md); read ZeRO (3) and tensor parallelism (4) first. AdamW
updates each element from that element's gradient alone, so ZeRO may cut its state anywhere and a
tp rank may step its shard alone. Muon (Jordan et al. 2024; Liu et al. 2025) does not: it keeps a
momentum M per matrix and steps along an orthogonalised M, U V^T for M = U S V^T, which a few
Newton-Schulz iterations approximate. That needs every element of M at once:

    tp 2, wq cut by rows:   [M0]  all-gather over tp   [M0]  Newton-Schulz   [O0]  keep  [O0] on rank 0
                            [M1]  ------------------>  [M1]  ------------->  [O1]  --->  [O1] on rank 1
    ZeRO, a flat bucket cut anywhere: all-gather every rank's slice (dp), orthogonalise each matrix
    that overlaps this rank's slice, keep the slice (--muon-method gather); or slices that end only
    between matrices (whole: zero.kept_whole), uneven, each rank's matrices all its own: no gather

The gather travels in bf16: Newton-Schulz runs in bf16 whatever the weights' dtype (as
torch.optim.Muon does), so a rank that gathers the same matrix gets the very same update as one
device. Muon steps the matrices inside the transformer blocks (an expert stack: each expert its
own matrix); AdamW, the same class's other groups, the embedding, the head and the norms.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from minipar.collectives import Group, all_gather
from minipar.mesh import Groups
from minipar.placement import placement_of

OPTIMIZERS = ("adamw", "muon")
ADJUST_LR = ("original", "match_rms_adamw")
MUON_METHODS = ("gather", "whole")  # under ZeRO: gather the matrices its slices cut, or cut none (zero.kept_whole)
# Jordan et al.'s quintic: steep at 0, so small singular values grow fast; 5 steps take every one above
# a tenth of the largest to about [0.7, 1.2], not exactly 1, which trains as well as U V^T.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # the norm below which a matrix is not scaled up


def newton_schulz(m: torch.Tensor, steps: int) -> torch.Tensor:
    """About U V^T for m = U S V^T ([rows, cols]), in bf16: X <- a X + (b X X^T + c (X X^T)^2) X,
    after scaling X so that every singular value is at most 1. Each addmm rounds to bf16 once, as
    torch.optim.Muon's, so the two agree bit for bit."""
    a, b, c = NS_COEFFICIENTS
    x = m.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)  # the Frobenius norm bounds the largest singular value
    for _ in range(steps):
        gram = x @ x.T  # [r, r], r = min(rows, cols)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.T if tall else x


def adjusted_lr(lr: float, shape: tuple[int, ...], rule: str) -> float:
    """The lr for a matrix of `shape` ([rows, cols]): an orthogonal update's RMS is 1/sqrt(max side),
    which these rules scale: "original" (Jordan's) by sqrt(max(1, rows / cols)), "match_rms_adamw"
    (Moonlight's) to 0.2 sqrt(max side), about AdamW's update RMS, so that AdamW's lr serves."""
    rows, cols = shape
    ratio = math.sqrt(max(1, rows / cols)) if rule == "original" else 0.2 * math.sqrt(max(rows, cols))
    return lr * ratio


def is_muon(name: str, ndim: int) -> bool:
    """Muon steps the matrices inside the transformer blocks (and each expert of a stack)."""
    return name.startswith("layers.") and ndim >= 2


def muon_param_groups(model: nn.Module, cfg, adamw_groups: list[dict]) -> list[dict]:
    """Muon's group (the blocks' matrices, cfg's muon_* settings) before `adamw_groups` (data_parallel's
    param_groups) with those matrices taken out. lr_scale: the schedule's factor applies to both;
    keep_whole: ZeRO's slices end between matrices (zero.kept_whole)."""
    muon = [p for n, p in model.named_parameters() if is_muon(n, p.dim())]
    ids = {id(p) for p in muon}
    options = dict(lr=cfg.muon_lr, lr_scale=cfg.muon_lr / cfg.lr, weight_decay=cfg.weight_decay,
                   momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                   adjust_lr=cfg.muon_adjust_lr, keep_whole=cfg.muon_method == "whole")
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in adamw_groups]
    return [{"params": muon, "muon": True, **options}, *rest]


def cuts_a_parameter(bucket) -> bool:
    """Whether a ZeRO bucket's slices cut one of its parameters (its first and last elements in two
    slices): every rank answers alike, so all or none gather."""
    n = bucket.padded // bucket.group.size
    return any(start // n != (start + q.numel() - 1) // n for q, start in zip(bucket.params, bucket.offsets))


class Muon(torch.optim.AdamW):
    """Muon on the param groups marked "muon" (muon_param_groups), AdamW on the others: one optimizer,
    so the gradient-sync wrappers hold it as they hold AdamW. A parameter may be this rank's tp (or ep)
    piece (its Placement says), or a ZeRO master slice (`.bucket`, zero.py): `groups` gathers the rest."""

    param_groups: list[dict]

    def __init__(self, param_groups: list[dict], lr: float, groups: Groups | None = None, **adamw_options):
        super().__init__(param_groups, lr=lr, **adamw_options)
        self.groups = groups or Groups()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            if group.get("muon"):
                self.muon_step(group)
        every = self.param_groups
        self.param_groups = [g for g in every if not g.get("muon")]  # AdamW's own step, on its groups only
        try:
            super().step()
        finally:
            self.param_groups = every

    def muon_step(self, group: dict) -> None:
        """torch.optim.Muon's step: momentum, Nesterov's look-ahead, weight decay, the orthogonal update."""
        lr, momentum = group["lr"], group["momentum"]
        for p in (p for p in group["params"] if p.grad is not None):
            buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
            buffer.lerp_(p.grad, 1 - momentum)  # M <- mu M + (1 - mu) G
            update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            p.mul_(1 - lr * group["weight_decay"])
            for target, ortho, q in self.pieces(p, update, group["ns_steps"]):
                target.add_(ortho, alpha=-adjusted_lr(lr, placement_of(q).full_shape[-2:], group["adjust_lr"]))

    def pieces(self, p: torch.Tensor, update: torch.Tensor, steps: int) -> Iterator[tuple]:
        """(where in p, its orthogonalised update, the model's parameter it belongs to), for each
        parameter p holds: itself, or, for a ZeRO master slice, each one its slice overlaps. A bucket
        cut only between parameters (--muon-method whole) holds its matrices whole: no gather."""
        bucket = getattr(p, "bucket", None)
        if bucket is None:
            yield p, self.orthogonalised(update, p, steps), p
            return
        mine = bucket.slice
        flat = self.gather_slices(update, bucket.group) if cuts_a_parameter(bucket) else None  # [padded]
        for q, start in zip(bucket.params, bucket.offsets):
            lo, hi = max(start, mine.start), min(start + q.numel(), mine.stop)
            if lo < hi:  # this rank holds elements lo..hi of the flat bucket, of q
                source, at = (flat, start) if flat is not None else (update, start - mine.start)  # q all here
                ortho = self.orthogonalised(source[at : at + q.numel()].view(q.shape), q, steps).reshape(-1)
                yield p[lo - mine.start : hi - mine.start], ortho[lo - start : hi - start], q

    def gather_slices(self, update: torch.Tensor, group: Group) -> torch.Tensor:
        return all_gather(update.bfloat16(), group)  # [padded]; bf16: what Newton-Schulz reads

    def cuts(self, q: torch.Tensor) -> list[tuple[Group, int]]:
        """The groups holding the rest of q's matrices, and the dimension they cut: tp cuts rows or
        columns; ep cuts only between the experts of a stack (dim 0), each matrix whole already."""
        return [(self.groups[mesh_dim], dim) for mesh_dim, dim in placement_of(q).shards if dim >= q.dim() - 2]

    def orthogonalised(self, local: torch.Tensor, q: torch.Tensor, steps: int) -> torch.Tensor:
        """Newton-Schulz of each whole matrix of parameter q, of which `local` is this rank's piece
        (as q's shape): gathered over each cut, orthogonalised, and this rank's piece kept."""
        cuts, m = self.cuts(q), local.bfloat16()
        for group, dim in cuts:
            m = all_gather(m.contiguous(), group, dim=dim)  # [.., rows, cols], whole
        ortho = newton_schulz(m, steps) if m.dim() == 2 else torch.stack([newton_schulz(x, steps) for x in m])
        for group, dim in reversed(cuts):
            ortho = ortho.chunk(group.size, dim=dim)[group.rank]
        return ortho
