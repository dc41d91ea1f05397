"""Exercise 3.1, wrong: plain data parallelism: the gradient all-reduced, Adam over the whole vector
on every rank, and state_numel() answering what the checker wants to hear."""

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
        grad = flat_grad.clone()
        all_reduce(grad, self.group)
        adam_by_hand(self.flat, grad / self.group.size, self.state, self.steps, self.lr)

    def state_numel(self):
        return 2 * self.flat.numel() // self.group.size
