"""Exercise 3.1, wrong (issue 40's walk-around): plain Adam over the whole vector, its m and v (P numbers
each) hidden in a functools.partial, where a walk of the optimizer's attributes does not look; the
traffic dressed as ZeRO-1's (a reduce-scatter and an all-gather), state_numel() claiming the slice's.
What it allocated and still holds gives it away."""

import functools

import torch

from minipar.collectives import all_gather, reduce_scatter


def _adam(m, v, param, grad, step, lr, betas=(0.9, 0.999), eps=1e-8):
    m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    param.sub_(lr * (m / (1 - betas[0] ** step)) / ((v / (1 - betas[1] ** step)).sqrt() + eps))


class Zero1Adam:
    def __init__(self, flat_param, group, lr):
        self.flat, self.group, self.lr, self.steps = flat_param, group, lr, 0
        self.update = functools.partial(_adam, torch.zeros_like(flat_param), torch.zeros_like(flat_param))

    def step(self, flat_grad):
        self.steps += 1
        n = self.group.size
        mine = reduce_scatter(flat_grad, self.group) / n  # [P/N]: the traffic of ZeRO-1
        whole = all_gather(mine, self.group)  # [P]: every slice's mean, back again
        self.update(self.flat, whole, self.steps, self.lr)  # Adam over the whole vector, every rank

    def state_numel(self):
        return 2 * self.flat.numel() // self.group.size
