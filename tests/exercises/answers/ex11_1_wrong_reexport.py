"""Exercise 11.1, wrong: the library's parallelize through a module that holds it
(minipar.planning.estimate), asked for selective recompute: it calls recompute_layers, which the
checker switches off."""

from minipar.planning.estimate import parallelize


def recompute_selectively(model):
    parallelize(model, recompute_selective=True)
