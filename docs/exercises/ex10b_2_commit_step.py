"""Exercise 10b.2 (chapter 10b, fault tolerance), implement: a step committed only if every replica
group can.

Replica groups each compute the gradient of their share of the global batch; the step's gradient
is their average. A group can die in the middle of that average: torchft's allreduce then returns
as if nothing happened, and the tensor may hold garbage. Nothing is lost as long as no rank acts on
it: every rank of every group votes (`should_commit`), and only if all say yes does any optimizer
step. A step not committed must change nothing (no weight, no optimizer state) and leave nothing
behind: the loop tries the same step again, on the same batch.

Write `ft_step(model, optimizer, batch, manager)`, one try of one step on this replica group:

  - x, y = batch; the loss is `model(x, y)` (a scalar: this group's share, a mean over its rows);
    backward;
  - average every parameter's gradient over the replica groups: `manager.allreduce(p.grad)`
    returns a work object: `.wait()` on it, and p.grad holds the mean of the groups', in place
    (torchft sums, then divides by the groups in wait(), where it also hears of an error);
  - then ask `manager.should_commit()` (True or False), once, after the last allreduce;
  - only if it says True, `optimizer.step()`;
  - in every case, return with no gradient left (each p.grad None or zero), so that the next try
    adds nothing to an old one; return what should_commit said.

The checker runs it on a small float64 model with Adam, against a fake torchft Manager that plays
the other two replica groups; one try fails (its first allreduce errs, as a lost group makes it,
and should_commit says False) and is tried again with the same batch. After each try the weights
and Adam's state must equal plain torch's (the groups' mean gradient, Adam stepping on the tries
that commit) to 1e-12, and the manager's log must show each gradient all-reduced once and waited
for, the vote after the last allreduce, and optimizer.step (a step pre-hook records it) only after
a yes.
`Replicas.gate` and `train_step` are switched off.

The library's own, after you tried: `Replicas.gate` in minipar/extras/replicas.py (one allreduce
per dtype, then the vote), the gate the wrapper's `clip_and_step` asks before its norm (on a no it
drops the gradients and steps nothing), and `train_step` in minipar/run/train.py (train_loop then
takes the same step again).

Check: make exercise N=10b.2 (one process, a second)
"""

import torch
from torch import nn


def ft_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, manager) -> bool:
    """One try of a step: backward, each gradient averaged over the replica groups, the vote, the
    optimizer's step on a yes; no gradient left behind. Returns whether the step was committed."""
    raise NotImplementedError("hint: model(x, y).backward(); for p in model.parameters(): "
                              "manager.allreduce(p.grad).wait(); then committed = manager.should_commit(); ...")
