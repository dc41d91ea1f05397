"""Exercise 4c.1, wrong: the tempting shortcut, each rank orthogonalises the pieces it holds (the rest of
each matrix left at zero), no message: another optimizer, and the result says so."""

import math

import torch

from minipar.muon import newton_schulz


def owner_step(mine, shapes, owner, group):
    per, at, out, offset = mine.numel(), group.rank * mine.numel(), torch.zeros_like(mine), 0
    for shape in shapes:
        size = math.prod(shape)
        lo, hi = max(offset, at), min(offset + size, at + per)
        if lo < hi:
            m = torch.zeros(size, dtype=mine.dtype)
            m[lo - offset : hi - offset] = mine[lo - at : hi - at]
            out[lo - at : hi - at] = newton_schulz(m.view(shape), 5).reshape(-1)[lo - offset : hi - offset].double()
        offset += size
    return out
