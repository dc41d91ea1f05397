"""Exercise 3.1, wrong: the traffic of ZeRO-1 (a reduce-scatter, an all-gather of P), but the
all-gather brings the averaged gradient back whole and every rank runs Adam on all of it: the
state that ZeRO-1 cuts by N is whole on every rank."""

import torch
import torch.distributed as dist  # noqa: F401

from minipar.collectives import all_gather, all_reduce, reduce_scatter  # noqa: F401


def adam_by_hand(param, grad, state, step: int, lr: float, betas=(0.9, 0.999), eps=1e-8) -> None:
    """torch.optim.Adam's update (its defaults), in place, written out."""
    m, v = state.setdefault("m", torch.zeros_like(param)), state.setdefault("v", torch.zeros_like(param))
    m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))


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
