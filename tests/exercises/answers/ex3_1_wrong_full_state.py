"""Exercise 3.1, wrong: the traffic of ZeRO-1 (a reduce-scatter, an all-gather of P), but the
all-gather brings the averaged gradient back whole and every rank runs Adam on all of it: the
state that ZeRO-1 cuts by N is whole on every rank."""

import sys
from pathlib import Path

import torch.distributed as dist  # noqa: F401

from minipar.collectives import all_gather, all_reduce, reduce_scatter  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checks_collectives import adam_by_hand  # noqa: E402


class Zero1Adam:
    def __init__(self, flat_param, group, lr):
        self.flat, self.group, self.lr = flat_param, group, lr
        self.state, self.steps = {}, 0

    def step(self, flat_grad):
        self.steps += 1
        grad = all_gather(reduce_scatter(flat_grad, self.group) / self.group.size, self.group)
        adam_by_hand(self.flat, grad, self.state, self.steps, self.lr)

    def state_numel(self):
        return 2 * self.flat.numel() // self.group.size
