"""Exercise 4.3, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""

import torch

from minipar.model import Llama, get_config


def ANSWER(v):  # noqa: N802 - a function of the variant (v.model, v.tp)
    with torch.device("meta"):
        named = list(Llama(get_config(v.model)).named_parameters())
    whole = sum(p.numel() for n, p in named if "norm" in n)
    cut = sum(p.numel() for n, p in named if "norm" not in n)
    return (cut / v.tp + whole) * 4 / 2**20
