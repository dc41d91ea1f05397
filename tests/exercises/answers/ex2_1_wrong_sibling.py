"""Exercise 2.1, wrong: ZeRO's wrapper, a sibling of DataParallel that averages gradients too."""

from minipar.zero import ZeroDataParallel


def install_grad_averaging(model, group):
    model.dp = ZeroDataParallel(model, group)
