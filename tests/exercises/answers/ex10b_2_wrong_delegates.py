"""Exercise 10b.2, wrong: the library's own Replicas.gate, on a Replicas made around the manager
(one flat allreduce, then the vote): the checker switches it off."""

from types import SimpleNamespace

from minipar.collectives import Ledger
from minipar.extras.replicas import Replicas


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
