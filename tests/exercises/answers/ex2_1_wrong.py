"""Exercise 2.1, a plausible wrong answer: the hooks sum the gradients instead of averaging them."""

from minipar.collectives import all_reduce


def install_grad_averaging(model, group):
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: all_reduce(p.grad, group))
