"""Exercise 4.1, wrong: the library's layers from a fresh copy of the module (importlib.reload): its functions
are new objects, which the old switch-off, one module attribute, did not reach (issue 40)."""

import importlib

import minipar.tensor_parallel

_fresh = importlib.reload(minipar.tensor_parallel)
ColumnParallelLinear, RowParallelLinear = _fresh.ColumnParallelLinear, _fresh.RowParallelLinear


def column_row_mlp(x, w1, w2, group):
    up = ColumnParallelLinear(w1.shape[1], w1.shape[0] * group.size, group, bias=False)
    down = RowParallelLinear(w2.shape[1] * group.size, w2.shape[0], group, bias=False)
    return down(up(x).tanh())
