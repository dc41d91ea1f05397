"""Exercise 4.3, wrong: tensor parallelism taken to cut the compute only, each rank keeping every weight."""

import torch

from minipar.model import Llama, get_config


def ANSWER(v):  # noqa: N802
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(get_config(v.model)).parameters()) * 4 / 2**20
