"""Exercise 0.1, a plausible wrong answer: the weights that autograd saves are counted too."""

import torch


def saved_activation_bytes(model, tokens):
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    return sum(kept.values())
