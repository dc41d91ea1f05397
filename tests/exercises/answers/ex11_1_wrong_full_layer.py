"""Wrong: the whole layer under the checkpoint, --recompute's answer: it keeps its input alone, and
attention runs again in backward too (a third more compute, where the MLP is some two thirds of it)."""

from functools import partial

from torch.utils.checkpoint import checkpoint


def recompute_mlps(model):
    for layer in model.layers.values():
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
