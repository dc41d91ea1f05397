"""Exercise 11.1, wrong: the library's pieces of its answer, called by torch rather than by the
answer: each layer under the student's own checkpoint, with the library's keep_expensive as its
policy. The policy runs later, inside the checker's training step, where no line of this file is on
the call stack; the checker switches it off there too."""

from functools import partial

from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from minipar.parallelize import keep_expensive


def recompute_selectively(model):
    for layer in model.layers.values():
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False,
                                context_fn=lambda: create_selective_checkpoint_contexts(keep_expensive))
