"""Exercise 2.1, wrong: the library's DataParallel wrapped around the model (its own hooks and
buckets): the checker switches it off."""

from minipar.data_parallel import DataParallel


def install_grad_averaging(model, group):
    model.dp = DataParallel(model, group)
