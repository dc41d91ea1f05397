"""Exercise 10b.2, right: the reference's step, which also averages its loss over the replica groups
for the log (as minipar's replica groups do), before the vote; the loss is no gradient, and fine."""


def ft_step(model, optimizer, batch, manager):
    x, y = batch
    loss = model(x, y)
    loss.backward()
    logged = loss.detach().clone()
    works = [manager.allreduce(logged)] + [manager.allreduce(p.grad) for p in model.parameters()]
    for work in works:
        work.wait()
    committed = manager.should_commit()
    if committed:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return committed
