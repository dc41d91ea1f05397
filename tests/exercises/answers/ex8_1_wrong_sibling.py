"""Exercise 8.1, wrong: minipar.precision's model_state_bytes (a sibling: the same table, by dtype),
its three figures added up."""

from types import SimpleNamespace

import torch

from minipar.precision import model_state_bytes as by_precision


def model_state_bytes(psi, n, stage, weight=2, grad=2, k=12):
    mixed = SimpleNamespace(working=torch.bfloat16, built=torch.float32, mixed=True)
    return sum(by_precision(psi, n, stage, mixed).values())
