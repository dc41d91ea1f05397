"""Exercise 0.1, the chapter's own count: scripts/course/step_00_one_device.py's saved-tensor hook."""

import torch


def saved_activation_bytes(model, tokens):
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    return sum(n for ptr, n in kept.items() if ptr not in weights)
