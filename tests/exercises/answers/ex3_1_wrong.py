"""Exercise 3.1, a plausible wrong answer: the updated slices are never all-gathered, so every rank
updates its own slice of flat_param and leaves the others at their old values."""

import sys
from pathlib import Path

from minipar.collectives import reduce_scatter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checks_collectives import adam_by_hand  # noqa: E402


class Zero1Adam:
    def __init__(self, flat_param, group, lr):
        self.flat, self.group, self.lr = flat_param, group, lr
        self.state, self.steps = {}, 0

    def step(self, flat_grad):
        self.steps += 1
        grad = reduce_scatter(flat_grad, self.group) / self.group.size
        adam_by_hand(self.flat.chunk(self.group.size)[self.group.rank], grad, self.state, self.steps, self.lr)

    def state_numel(self):
        return sum(t.numel() for t in self.state.values())
