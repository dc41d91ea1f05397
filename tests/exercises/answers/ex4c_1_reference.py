"""Exercise 4c.1, an answer: two all-to-alls in bf16, each matrix whole on its owner."""

import math

import torch

from minipar.collectives import all_to_all
from minipar.muon import newton_schulz


def owner_step(mine, shapes, owner, group):
    n, per = group.size, mine.numel()
    sizes = [math.prod(s) for s in shapes]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def part(i, r):  # matrix i's numbers in rank r's slice, as a range of the flat vector
        lo = max(offsets[i], r * per)
        return range(lo, max(lo, min(offsets[i] + sizes[i], (r + 1) * per)))

    me, at = group.rank, group.rank * per
    out = [[(i, part(i, me)) for i in range(len(shapes)) if owner[i] == r] for r in range(n)]  # to rank r
    into = [[(i, part(i, r)) for i in range(len(shapes)) if owner[i] == me] for r in range(n)]  # from rank r
    send = torch.cat([mine[:0], *(mine[s.start - at : s.stop - at] for x in out for _, s in x)]).bfloat16()
    got = all_to_all(send, group, send_splits=[sum(len(s) for _, s in x) for x in out],
                     recv_splits=[sum(len(s) for _, s in x) for x in into])
    whole = {i: send.new_zeros(sizes[i]) for i in range(len(shapes)) if owner[i] == me}
    for (i, s), piece in zip([y for x in into for y in x], got.split([len(s) for x in into for _, s in x])):
        whole[i][s.start - offsets[i] : s.stop - offsets[i]] = piece
    ortho = {i: newton_schulz(m.view(shapes[i]), 5).reshape(-1) for i, m in whole.items()}
    back = torch.cat([send[:0], *(ortho[i][s.start - offsets[i] : s.stop - offsets[i]] for x in into for i, s in x)])
    got = all_to_all(back, group, send_splits=[sum(len(s) for _, s in x) for x in into],
                     recv_splits=[sum(len(s) for _, s in x) for x in out])
    result = torch.zeros(per, dtype=torch.bfloat16)
    for (_, s), piece in zip([y for x in out for y in x], got.split([len(s) for x in out for _, s in x])):
        result[s.start - at : s.stop - at] = piece
    return result
