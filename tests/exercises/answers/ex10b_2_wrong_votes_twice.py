"""Exercise 10b.2, wrong (issue 40's walk-around): asks should_commit() twice, once to decide and once
to report. torchft's should_commit is the step's vote, to be called once per step: a second call is
a second round of the commit protocol."""


def ft_step(model, optimizer, batch, manager):
    x, y = batch
    model(x, y).backward()
    for p in model.parameters():
        manager.allreduce(p.grad).wait()
    if manager.should_commit():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return manager.should_commit()
