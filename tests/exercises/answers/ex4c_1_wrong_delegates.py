"""Exercise 4c.1, wrong: the library's own Muon.owner_pieces, on a ZeRO-like bucket: the checker switches it off."""

import math
from types import SimpleNamespace

import torch

from minipar.muon import Muon


def owner_step(mine, shapes, owner, group):
    sizes = [math.prod(s) for s in shapes]
    params = [torch.zeros(s) for s in shapes]
    bucket = SimpleNamespace(params=params, offsets=[sum(sizes[:i]) for i in range(len(sizes))],
                             padded=mine.numel() * group.size, group=group,
                             slice=slice(group.rank * mine.numel(), (group.rank + 1) * mine.numel()))
    out = torch.zeros_like(mine)
    muon = Muon([{"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=1.0)
    muon.loads = {}
    for target, ortho, _ in muon.owner_pieces(out, mine, bucket, 5):
        target.copy_(ortho)
    return out
