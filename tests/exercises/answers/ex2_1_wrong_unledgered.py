"""Exercise 2.1, wrong: torch.distributed.all_reduce on the group's process group, past minipar's
collectives: the gradients are right, but the ledger never sees the traffic (and every later chapter
counts on it)."""

import torch.distributed as dist


def install_grad_averaging(model, group):
    def average(p):
        dist.all_reduce(p.grad, group=group.pg)
        p.grad.div_(group.size)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
