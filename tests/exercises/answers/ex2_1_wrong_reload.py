"""Exercise 2.1, wrong: the library's DataParallel from a fresh copy of the module (importlib.reload): its
functions are new objects, which the old switch-off, one module attribute, did not reach (issue 40)."""

import importlib

import minipar.data_parallel


def install_grad_averaging(model, group):
    model.dp = importlib.reload(minipar.data_parallel).DataParallel(model, group)
