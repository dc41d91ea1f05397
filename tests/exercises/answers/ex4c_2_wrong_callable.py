"""Exercise 4c.2, wrong: the reference's formula as a function of the variant, which the checker would
run: a prediction is a value written out, and code that computes it is refused."""

import torch

from minipar.model import Llama, get_config


def muon_numbers(model: str) -> int:
    with torch.device("meta"):  # shapes only: no memory
        m = Llama(get_config(model))
    return sum(p.numel() for n, p in m.named_parameters() if n.startswith("layers.") and p.dim() == 2)


def ANSWER(v):  # noqa: N802 - a function of the variant (v.model, v.dp)
    return (v.dp - 1) / v.dp * 2 * muon_numbers(v.model) / 2**20
