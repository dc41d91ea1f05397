"""Exercise 10b.2, wrong: asks should_commit, then steps whatever it said."""


def ft_step(model, optimizer, batch, manager):
    x, y = batch
    model(x, y).backward()
    for p in model.parameters():
        manager.allreduce(p.grad).wait()
    committed = manager.should_commit()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return committed
