"""Exercise 4.3, wrong: tensor parallelism taken to cut the compute only, each rank keeping every weight."""

import torch

from minipar.model import Llama, get_config


def formula(v):
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(get_config(v.model)).parameters()) * 4 / 2**20


SEED = 0  # the variant whose answer is written out below; formula(v) answers every one
ANSWER = 30633.015625
