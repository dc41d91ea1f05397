"""Wrong: attention under the checkpoint instead of the MLP: the smaller share of the activations
given up, for the larger share of the compute done again (its scores grow with the sequence)."""

from functools import partial

from torch.utils.checkpoint import checkpoint


def recompute_mlps(model):
    for layer in model.layers.values():
        layer.attn.forward = partial(checkpoint, layer.attn.forward, use_reentrant=False)
