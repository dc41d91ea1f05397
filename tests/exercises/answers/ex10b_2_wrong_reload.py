"""Exercise 10b.2, wrong: the library's Replicas.gate from a fresh copy of the module (importlib.reload): its
functions are new objects, which the old switch-off, one module attribute, did not reach (issue 40)."""

import importlib
from types import SimpleNamespace

import minipar.extras.replicas
from minipar.collectives import Ledger

Replicas = importlib.reload(minipar.extras.replicas).Replicas


def ft_step(model, optimizer, batch, manager):
    x, y = batch
    model(x, y).backward()
    replicas = Replicas.__new__(Replicas)  # no lighthouse: only what the gate reads
    replicas.manager, replicas.size, replicas.mesh = manager, manager.num_participants(), SimpleNamespace(
        ledger=Ledger())
    replicas.step, replicas.say = 0, lambda line: None  # what a refused step's line reads
    committed = replicas.gate([p.grad for p in model.parameters()])
    if committed:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return committed
