"""Exercise 3.2, wrong: the reference's formula as a function of the variant, which the checker would run: a
prediction is a value written out, and code that computes it is refused."""

import torch

from minipar.model import Llama, get_config


def parameters(model: str) -> int:
    with torch.device("meta"):  # shapes only: no memory
        return sum(p.numel() for p in Llama(get_config(model)).parameters())


def ANSWER(v):  # noqa: N802 - a function of the variant (v.model, v.dp)
    return 3 * (v.dp - 1) / v.dp * 4 * parameters(v.model) / 2**20
