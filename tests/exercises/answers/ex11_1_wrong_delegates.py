"""Wrong: the library's own answer, called."""

from minipar.parallelize import keep_expensive, recompute_layers


def recompute_selectively(model):
    recompute_layers(model, keep_expensive)
