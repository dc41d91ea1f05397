"""Exercise 10b.2, wrong: each group steps on its own gradient, never averaged over the groups."""


def ft_step(model, optimizer, batch, manager):
    x, y = batch
    model(x, y).backward()
    committed = manager.should_commit()
    if committed:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return committed
