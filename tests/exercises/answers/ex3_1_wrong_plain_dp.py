"""Exercise 3.1, wrong: plain data parallelism: the gradient all-reduced, Adam over the whole vector
on every rank, and state_numel() answering what the checker wants to hear."""

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
        grad = flat_grad.clone()
        all_reduce(grad, self.group)
        adam_by_hand(self.flat, grad / self.group.size, self.state, self.steps, self.lr)

    def state_numel(self):
        return 2 * self.flat.numel() // self.group.size
