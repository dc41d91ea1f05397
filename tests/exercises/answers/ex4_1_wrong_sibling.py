"""Exercise 4.1, wrong: the library's ParallelMLP (column then row, a sibling), on a plain MLP."""

import torch
from torch import nn

from minipar.parallelize import ParallelMLP


def column_row_mlp(x, w1, w2, group):
    plain = nn.Sequential(nn.Linear(w1.shape[1], w1.shape[0] * group.size, bias=False), nn.Tanh(),
                          nn.Linear(w2.shape[1] * group.size, w2.shape[0], bias=False)).to(torch.float64)
    return ParallelMLP(plain, group, False)(x)
