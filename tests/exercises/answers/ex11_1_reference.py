"""Exercise 11.1, as the library does it (parallelize.recompute_layers with keep_expensive): each layer
under a non-reentrant checkpoint whose selective policy keeps the matmuls' and attention's outputs;
the norms, RoPE, SiLU and products run again in backward, the kept outputs taken from the cache."""

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

KEPT = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def keep_expensive(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_selectively(model):
    for layer in model.layers.values():
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False,
                                context_fn=lambda: create_selective_checkpoint_contexts(keep_expensive))
