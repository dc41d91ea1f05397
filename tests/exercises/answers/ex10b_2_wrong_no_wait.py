"""Exercise 10b.2, wrong: launches each allreduce and never waits for it (torchft divides by the
groups in wait(): the optimizer steps on their sum)."""


def ft_step(model, optimizer, batch, manager):
    x, y = batch
    model(x, y).backward()
    for p in model.parameters():
        manager.allreduce(p.grad)
    committed = manager.should_commit()
    if committed:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return committed
