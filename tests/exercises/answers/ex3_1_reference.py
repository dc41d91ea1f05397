"""Exercise 3.1, built from the library's pieces: minipar.collectives' reduce_scatter and all_gather
around Adam on this rank's slice (written out, as the checker's one-device reference is)."""

import torch

from minipar.collectives import all_gather, reduce_scatter


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
        self.shard = flat_param.chunk(group.size)[group.rank].clone()  # [P/N]
        self.state, self.steps = {}, 0

    def step(self, flat_grad):
        self.steps += 1
        grad = reduce_scatter(flat_grad, self.group) / self.group.size  # [P/N]
        adam_by_hand(self.shard, grad, self.state, self.steps, self.lr)
        self.flat.copy_(all_gather(self.shard, self.group))  # [P]

    def state_numel(self):
        return sum(t.numel() for t in self.state.values())
