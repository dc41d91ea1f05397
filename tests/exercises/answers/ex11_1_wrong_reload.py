"""Exercise 11.1, wrong: the library's recompute_layers from a fresh copy of its module
(importlib.reload): the checker switches off the reloaded one too."""

import importlib

import minipar.parallelize


def recompute_selectively(model):
    library = importlib.reload(minipar.parallelize)
    library.recompute_layers(model, library.keep_expensive)
