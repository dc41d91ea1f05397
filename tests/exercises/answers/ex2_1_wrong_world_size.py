"""Exercise 2.1, wrong: the hooks divide by the world's size, not the group's: right when the group is
the world, half the gradient when it is two ranks of four."""

import torch.distributed as dist

from minipar.collectives import all_reduce


def install_grad_averaging(model, group):
    def average(p):
        all_reduce(p.grad, group)
        p.grad.div_(dist.get_world_size())

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
