"""Exercise 10b.2, wrong: votes before the average, so an error during the allreduce is never heard."""


def ft_step(model, optimizer, batch, manager):
    x, y = batch
    model(x, y).backward()
    committed = manager.should_commit()
    for p in model.parameters():
        manager.allreduce(p.grad).wait()
    if committed:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return committed
