"""Exercise 4.1, wrong: f and g swapped: the all-reduce on the way in (adding up the ranks' copies of
x) and the identity on the way out."""

import torch

from minipar.autograd_ops import copy_to_parallel, reduce_from_parallel


def column_row_mlp(x, w1, w2, group):
    hidden = torch.tanh(reduce_from_parallel(x, group) @ w1.T)
    return copy_to_parallel(hidden @ w2.T, group)
