"""Exercise 10b.2, wrong: the library's own train_step, its replica groups given the manager: the
checker switches it off."""

from types import SimpleNamespace

from minipar.run.train import train_step


def ft_step(model, optimizer, batch, manager):
    replicas = SimpleNamespace(manager=manager, size=manager.num_participants())
    loss, norm = train_step(SimpleNamespace(module=model, optimizer=optimizer), [batch], replicas=replicas)
    return norm is not None
