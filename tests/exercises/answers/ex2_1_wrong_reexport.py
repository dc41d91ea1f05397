"""Exercise 2.1, wrong: the library's DataParallel, through its re-export in parallelize."""

from minipar.parallelize import DataParallel


def install_grad_averaging(model, group):
    model.dp = DataParallel(model, group)
