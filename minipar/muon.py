"""Muon: an optimizer whose update of a weight needs the whole matrix, in every layout (chapter 4c).

Muon steps along U V^T for its momentum M = U S V^T (Newton-Schulz), which needs all of M: tp gathers
its shards; ZeRO's slices, three ways (--muon-method): every rank gathers (gather), one owner per
matrix gathers and sends the slices back (owner), or none is cut (whole). Gathers travel in bf16, what
Newton-Schulz reads (as torch.optim.Muon's): one device's very update. AdamW steps the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from minipar.collectives import Group, all_gather, all_to_all
from minipar.mesh import Groups
from minipar.placement import placement_of

OPTIMIZERS = ("adamw", "muon")
ADJUST_LR = ("original", "match_rms_adamw")
MUON_METHODS = ("gather", "owner", "whole")  # under ZeRO: each rank gathers, one owner per matrix, or no cut
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic: 5 steps take singular values > max/10 to ~[0.7, 1.2]
NS_EPS = 1e-7  # the norm below which a matrix is not scaled up


def newton_schulz(m: torch.Tensor, steps: int) -> torch.Tensor:
    """About U V^T for m = U S V^T ([rows, cols]), in bf16: X <- a X + (b X X^T + c (X X^T)^2) X, X
    scaled to singular values at most 1. Each addmm rounds once, as torch.optim.Muon's: bit for bit."""
    (a, b, c), tall = NS_COEFFICIENTS, m.shape[0] > m.shape[1]
    x = m.bfloat16().T if tall else m.bfloat16()  # tall: iterate on the wide side, X X^T the smaller Gram matrix
    x = x / x.norm().clamp(min=NS_EPS)  # the Frobenius norm bounds the largest singular value
    for _ in range(steps):
        gram = x @ x.T  # [r, r], r = min(rows, cols)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.T if tall else x


def adjusted_lr(lr: float, shape: tuple[int, ...], rule: str) -> float:
    """The lr for a [rows, cols] matrix (an orthogonal update's RMS is 1/sqrt(max side)): "original"
    (Jordan's) x sqrt(max(1, rows / cols)); "match_rms_adamw" (Moonlight's) x 0.2 sqrt(max side), AdamW's RMS."""
    rows, cols = shape
    return lr * (math.sqrt(max(1, rows / cols)) if rule == "original" else 0.2 * math.sqrt(max(rows, cols)))


def is_muon(name: str, ndim: int) -> bool:
    """Muon steps the matrices inside the transformer blocks (and each expert of a stack)."""
    return name.startswith("layers.") and ndim >= 2


def muon_ids(model: nn.Module) -> set[int]:
    return {id(p) for n, p in model.named_parameters() if is_muon(n, p.dim())}


def split_groups(model: nn.Module, adamw_groups: list[dict]) -> tuple[list[nn.Parameter], list[dict]]:
    """(Muon's matrices, `adamw_groups` (data_parallel.param_groups) with them taken out)."""
    ids = muon_ids(model)
    return [p for p in model.parameters() if id(p) in ids], [
        {**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in adamw_groups]


def muon_param_groups(model: nn.Module, cfg, adamw_groups: list[dict]) -> list[dict]:
    """Muon's group (cfg's muon_* settings; the schedule scales both by lr_scale) before AdamW's."""
    muon, rest = split_groups(model, adamw_groups)
    options = dict(lr=cfg.muon_lr, lr_scale=cfg.muon_lr / cfg.lr, weight_decay=cfg.weight_decay,
                   momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                   adjust_lr=cfg.muon_adjust_lr, keep_whole=cfg.muon_method == "whole",
                   owner=cfg.muon_method == "owner")
    return [{"params": muon, "muon": True, **options}, *rest]


def whole_shape(q: torch.Tensor) -> tuple[int, ...]:
    """The shape of q's matrices whole (tp gathers them), [this rank's matrices, rows, cols]."""
    return (*q.shape[:-2], *placement_of(q).full_shape[-2:])


def ns_flops(shape: tuple[int, ...], steps: int) -> int:
    """Newton-Schulz's FLOPs on matrices of `shape` ([.., rows, cols]), r the short side, c the long:
    each step X X^T (2 r r c), its square (2 r^3) and that times X (2 r r c)."""
    r, c = min(shape[-2:]), max(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * r * r * c + 2 * r**3)


def owners(flops: list[int], n: int, load: list[int] | None = None) -> list[int]:
    """Each matrix's owner among n ranks, balanced by FLOPs: the largest first, each to the rank with
    the fewest so far (`load`: the step's earlier buckets'; ties: the lowest). Every rank works it out."""
    load, owner = [0] * n if load is None else load, [0] * len(flops)
    for i in sorted(range(len(flops)), key=lambda i: -flops[i]):
        owner[i] = min(range(n), key=load.__getitem__)
        load[owner[i]] += flops[i]
    return owner


def part(bucket, i: int, r: int) -> range:
    """The elements of bucket's parameter i that rank r's slice holds, as a range of the flat bucket."""
    per, start = bucket.padded // bucket.group.size, bucket.offsets[i]
    lo = max(start, r * per)
    return range(lo, max(lo, min(start + bucket.params[i].numel(), (r + 1) * per)))  # empty: lo..lo


def cuts_a_parameter(bucket) -> bool:
    """Whether a ZeRO bucket's slices cut one of its parameters: every rank answers alike."""
    n = bucket.padded // bucket.group.size
    return any(start // n != (start + q.numel() - 1) // n for q, start in zip(bucket.params, bucket.offsets))


class Muon(torch.optim.AdamW):
    """Muon on the param groups marked "muon", AdamW on the others: one optimizer, held as AdamW is. A
    parameter may be a tp (or ep) piece (its Placement), or a ZeRO master slice (`.bucket`, zero.py)."""

    param_groups: list[dict]

    def __init__(self, param_groups: list[dict], lr: float, groups: Groups | None = None, **adamw_options):
        super().__init__(param_groups, lr=lr, **adamw_options)
        self.groups = groups or Groups()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        every = self.param_groups
        for group in (g for g in every if g.get("muon")):
            self.muon_step(group)
        self.param_groups = [g for g in every if not g.get("muon")]  # AdamW's own step, on its groups only
        try:
            super().step()
        finally:
            self.param_groups = every

    def muon_step(self, group: dict) -> None:
        """torch.optim.Muon's step: momentum, Nesterov's look-ahead, weight decay, the orthogonal update."""
        self.loads: dict[str, list[int]] = {}  # --muon-method owner: each dp group's FLOPs so far
        lr, momentum = group["lr"], group["momentum"]
        for p in (p for p in group["params"] if p.grad is not None):
            buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
            buffer.lerp_(p.grad, 1 - momentum)  # M <- mu M + (1 - mu) G
            update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            p.mul_(1 - lr * group["weight_decay"])
            for target, ortho, q in self.pieces(p, update, group["ns_steps"], group.get("owner", False)):
                target.add_(ortho, alpha=-adjusted_lr(lr, placement_of(q).full_shape[-2:], group["adjust_lr"]))

    def pieces(self, p: torch.Tensor, update: torch.Tensor, steps: int, owner: bool = False) -> Iterator[tuple]:
        """(where in p, its orthogonalised update, the parameter): for p, or each a ZeRO slice p overlaps."""
        bucket = getattr(p, "bucket", None)
        if bucket is None:
            yield p, self.orthogonalised(update, p, steps), p
            return
        if owner and cuts_a_parameter(bucket):
            yield from self.owner_pieces(p, update, bucket, steps)
            return
        at, cut = bucket.slice.start, cuts_a_parameter(bucket)
        flat = self.gather_slices(update, bucket.group) if cut else update  # [padded], or q all here
        for i, (q, start) in enumerate(zip(bucket.params, bucket.offsets)):
            if len(s := part(bucket, i, bucket.group.rank)):  # this rank holds elements s of the bucket, of q
                o = start - (0 if cut else at)
                ortho = self.orthogonalised(flat[o : o + q.numel()].view(q.shape), q, steps).reshape(-1)
                yield p[s.start - at : s.stop - at], ortho[s.start - start : s.stop - start], q

    def owner_pieces(self, p: torch.Tensor, update: torch.Tensor, bucket, steps: int) -> Iterator[tuple]:
        """One owner per matrix (Moonlight's): an all-to-all (bf16) sends each owner its matrices' parts,
        it orthogonalises them whole, and a second sends each rank its part back."""
        group, at, off = bucket.group, bucket.slice.start, bucket.offsets
        load = self.loads.setdefault(group.name, [0] * group.size)  # balanced over the step's buckets
        owner = owners([ns_flops(whole_shape(q), steps) for q in bucket.params], group.size, load)
        mine = [i for i, o in enumerate(owner) if o == group.rank]
        out = [[(i, part(bucket, i, group.rank)) for i, o in enumerate(owner) if o == r] for r in range(group.size)]
        into = [[(i, part(bucket, i, r)) for i in mine] for r in range(group.size)]  # from rank r, to me
        sizes_out, sizes_in = ([sum(len(s) for _, s in x) for x in xs] for xs in (out, into))
        sent = torch.cat([update[s.start - at : s.stop - at] for x in out for _, s in x]).bfloat16()
        got = all_to_all(sent, group, send_splits=sizes_out, recv_splits=sizes_in)
        whole = {i: sent.new_empty(bucket.params[i].numel()) for i in mine}  # each of my matrices, flat
        for (i, s), piece in zip((y for x in into for y in x), got.split([len(s) for x in into for _, s in x])):
            whole[i][s.start - off[i] : s.stop - off[i]] = piece
        ortho = {i: self.orthogonalised(whole[i].view(bucket.params[i].shape), bucket.params[i], steps).reshape(-1)
                 for i in mine}  # sent[:0] below: a rank may own no matrix
        back = torch.cat([sent[:0], *(ortho[i][s.start - off[i] : s.stop - off[i]] for x in into for i, s in x)])
        got = all_to_all(back, group, send_splits=sizes_in, recv_splits=sizes_out)
        for (i, s), piece in zip((y for x in out for y in x), got.split([len(s) for x in out for _, s in x])):
            if len(s):
                yield p[s.start - at : s.stop - at], piece, bucket.params[i]

    def gather_slices(self, update: torch.Tensor, group: Group) -> torch.Tensor:
        return all_gather(update.bfloat16(), group)  # [padded]; bf16: what Newton-Schulz reads

    def cuts(self, q: torch.Tensor) -> list[tuple[Group, int]]:
        """The groups holding the rest of q's matrices and the dimension they cut (tp's; ep cuts between)."""
        return [(self.groups[mesh_dim], dim) for mesh_dim, dim in placement_of(q).shards if dim >= q.dim() - 2]

    def orthogonalised(self, local: torch.Tensor, q: torch.Tensor, steps: int) -> torch.Tensor:
        """Newton-Schulz of q's whole matrices from this rank's piece `local`: gathered, and its piece kept."""
        cuts, m = self.cuts(q), local.bfloat16()
        for group, dim in cuts:
            m = all_gather(m.contiguous(), group, dim=dim)  # [.., rows, cols], whole
        ortho = newton_schulz(m, steps) if m.dim() == 2 else torch.stack([newton_schulz(x, steps) for x in m])
        for group, dim in reversed(cuts):
            ortho = ortho.chunk(group.size, dim=dim)[group.rank]
        return ortho
