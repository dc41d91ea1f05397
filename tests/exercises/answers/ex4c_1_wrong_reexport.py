"""Exercise 4c.1, wrong: the library's Muon.owner_pieces through a module that imports the class
(minipar.parallelize): the checker switches off every holder."""

import math
from types import SimpleNamespace

import torch

from minipar.parallelize import Muon


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
