"""Exercise 0.1, wrong: each saved tensor counted by its own size, so views of one storage are
counted again and again (and a view's size is not its storage's)."""

import torch


def saved_activation_bytes(model, tokens):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in weights:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    return total
