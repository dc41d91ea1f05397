"""The checkers of chapter 10b's exercises (docs/10b_fault_tolerance.md): fault-tolerant data
parallelism on torchft's replica groups.

10b.1, predict: the GPU-hours a run expects to lose to failures, with checkpoint-restart and with
replica groups; the key is `minipar.extras.replicas.lost_gpu_hours`, called once each way.

10b.2, implement: one step of the commit protocol, `ft_step(model, optimizer, batch, manager)`:
forward and backward, each gradient averaged over the replica groups (manager.allreduce), the vote
(manager.should_commit), the optimizer's step only if it says yes, no gradient left behind. In one
process, in float64: a fake of torchft's Manager plays replica group 0 of GROUPS, the other groups'
gradients computed here at the reference's weights, and one try fails (its first allreduce errs and
leaves the tensor corrupt, as torchft's may; the vote then says no), after which the same batch is
tried again. It grades the algorithm two ways:

    1. the weights and Adam's state after each try equal those of plain torch (the mean of the
       groups' gradients, Adam's step on the tries that commit, nothing on the one that fails);
    2. the fake's log of each try's calls: every gradient all-reduced once and its work waited for,
       the vote after the last allreduce, optimizer.step (a step pre-hook) after the vote and only
       when it said yes, and no p.grad left when ft_step returns (the retry would add to it).

The library's own answer (Replicas.gate, train.train_step) is switched off while the student's
code runs.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.distributed as dist
from check_common import NotImplementedYet, Predict, attempt, load, max_diff, numbers_problems, switched_off
from torch import nn

# -- 10b.1 Expected lost GPU-hours ---------------------------------------------------------------


@lru_cache
def truth_lost_gpu_hours(gpus: int, mtbf: int, days: int, restart_min: int, checkpoint_hours: float,
                         group_gpus: int) -> tuple[float, float]:
    """(checkpoint-restart's, replica groups') expected GPU-hours lost: the library's own."""
    from minipar.extras.replicas import lost_gpu_hours
    hours, restart = days * 24, restart_min / 60
    return (lost_gpu_hours(gpus, mtbf, hours, restart, checkpoint_every_hours=checkpoint_hours),
            lost_gpu_hours(gpus, mtbf, hours, restart, group_gpus=group_gpus))


# Llama 3's run (16,384 GPUs, 54 days, a GPU MTBF of about 50,700 h) is the chapter's: none here. The
# cases where checkpoint-restart would lose over 40% of the run (the linear model's limit) are left out.
LOST_SPACE = [dict(gpus=g, mtbf=m, days=d, restart_min=r, checkpoint_hours=c, group_gpus=gg)
              for g in (1024, 2048, 4096, 8192, 16384) for m in (20_000, 30_000, 40_000, 80_000) for d in (30, 90)
              for r in (10, 30) for c in (1, 3) for gg in (64, 512) if g * (r / 60 + c / 2) / m <= 0.4]


def _hours(h: float) -> str:
    return "hour" if h == 1 else f"{h} hours"


def _lost_question(v: dict) -> str:
    return (f"a run of {v['days']} days on {v['gpus']:,} GPUs, each GPU failing once per {v['mtbf']:,} hours on "
            f"average (independently), a restart taking {v['restart_min']} minutes: how many GPU-hours does it "
            f"expect to lose (1) with checkpoint-restart, a checkpoint every {_hours(v['checkpoint_hours'])} (a "
            f"failure stops every GPU for the restart and throws away the work since the last checkpoint), and (2) "
            f"with replica groups of {v['group_gpus']} GPUs (a failure stops its own group for the restart; the "
            f"others train on: leave the step in flight out)?")


def _lost_problems(answer, v: dict) -> list[str]:
    truths = truth_lost_gpu_hours(**v)
    problems = numbers_problems(answer, truths, 0.01, ("with checkpoint-restart", "with replica groups"),
                                "failures x the GPUs each one stops x the hours each loses; "
                                "minipar.extras.replicas.lost_gpu_hours")
    if problems and isinstance(answer, (tuple, list)) and answer:  # a whole interval lost, not half of one
        failures = v["gpus"] * v["days"] * 24 / v["mtbf"]
        whole = failures * v["gpus"] * (v["restart_min"] / 60 + v["checkpoint_hours"])
        if not numbers_problems(answer[:1], (whole,), 0.01, ("",), ""):
            problems.append("with checkpoint-restart, a failure comes anywhere in the interval between two "
                            "checkpoints: it throws away half an interval on average, not a whole one")
    return problems


check_predict_lost_gpu_hours = Predict(
    LOST_SPACE, _lost_question, _lost_problems,
    lambda v: [f"{x:,.0f} GPU-hours" for x in truth_lost_gpu_hours(**v)]
    + [f"{x:,.0f} GPU-h" for x in truth_lost_gpu_hours(**v)])


# -- 10b.2 A step committed only if every replica group can --------------------------------------

COMMIT_OFF = ("minipar.extras.replicas:Replicas.gate", "minipar.run.train:train_step")
GROUPS, ROWS, D_IN, HIDDEN, LR = 3, 4, 5, 6, 0.05  # 3 replica groups, each 4 rows a step; Adam's lr
# The tries, in order: (step, whether it fails). Step 3's first try fails; the same batch is tried again.
TRIES = ((0, False), (1, False), (2, True), (2, False), (3, False))


class Tiny(nn.Module):
    """A two-layer regression in float64: model(x, y) is the batch's mean squared error."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(D_IN, HIDDEN).double(), nn.Linear(HIDDEN, 1).double()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.out(torch.tanh(self.hidden(x))) - y) ** 2).mean()


def global_batch(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step `step`'s batch as the groups' shares: [(x, y)] of ROWS rows each, group 0's first."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GROUPS * ROWS, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(GROUPS * ROWS, 1, generator=g, dtype=torch.float64)
    return list(zip(x.split(ROWS), y.split(ROWS)))


class Work:
    """An allreduce in flight. torchft's divides the summed tensor by the groups taking part in wait()
    (its callback, and where an error is reported): not waited for, the tensor holds the sum."""

    def __init__(self, tensor: torch.Tensor, names: list[str], log: list, divisor: int = 1):
        self.tensor, self.names, self.log, self.divisor, self.waited = tensor, names, log, divisor, False

    def wait(self, timeout=None) -> bool:
        self.log.append(("wait", self.names))
        if not self.waited:
            self.waited = True
            self.tensor.div_(self.divisor)
        return True


class FakeManager:
    """torchft's Manager as replica group 0's ft_step sees it. allreduce(t) sums t, in place, with the
    other groups' gradients of the same tensor (a gradient of the model, or all of them flat, in
    model.parameters() order), and its work's wait() divides by the groups (reduce_op=SUM: no
    division). On a try that fails, the first allreduce errs: its tensor is left corrupt (NaN), each
    later one is a no-op, and should_commit() says False. `log`: what ft_step called, in order:
    ("allreduce", [names]), ("wait", [names]), ("should_commit", vote), ("step",); `works`: the
    allreduces' works. A tensor that is none of the gradients (names []) is summed with nothing: a
    scalar is the loss or a metric for the log, which a step may average too."""

    def __init__(self, model: nn.Module):
        self.model, self.log, self.works, self.others, self.fails, self.errored = model, [], [], [], False, False

    def start_quorum(self, others: list[dict[str, torch.Tensor]], fails: bool) -> None:
        """A new try: the other groups' gradients at it, and whether it fails."""
        self.others, self.fails, self.errored, self.log, self.works = others, fails, False, [], []

    def num_participants(self) -> int:
        return GROUPS

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op=None) -> Work:
        names = self._which(tensor)
        self.log.append(("allreduce", names))
        self.works.append(Work(tensor, names, self.log))
        if self.errored:  # torchft: after the first error every allreduce returns at once
            return self.works[-1]
        if self.fails:  # a group lost during it: the tensor may hold anything
            self.errored = True
            tensor.fill_(math.nan)
            return self.works[-1]
        if names:
            total = tensor.detach().clone()
            for theirs in self.others:
                total += torch.cat([theirs[n].reshape(-1) for n in names]).view_as(tensor)
            tensor.copy_(total)
            self.works[-1].divisor = 1 if reduce_op is not None and reduce_op == dist.ReduceOp.SUM else GROUPS
        return self.works[-1]

    def should_commit(self, timeout=None) -> bool:
        self.log.append(("should_commit", not self.errored))
        return not self.errored

    def _which(self, tensor: torch.Tensor) -> list[str]:
        """The names of the gradients `tensor` is: one (its storage, or its values), or all, flat."""
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        ptr = tensor.untyped_storage().data_ptr()
        for n, g in grads.items():
            if g.shape == tensor.shape and (g.untyped_storage().data_ptr() == ptr or torch.equal(g, tensor)):
                return [n]
        names = [n for n, _ in self.model.named_parameters()]
        if len(grads) == len(names) and tensor.numel() == sum(g.numel() for g in grads.values()):
            if torch.equal(tensor.reshape(-1), torch.cat([g.reshape(-1) for g in grads.values()])):
                return names
        return []


def group_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """One group's gradients on its share, at `model`'s weights (its .grad untouched)."""
    names, params = zip(*model.named_parameters())
    return dict(zip(names, torch.autograd.grad(model(x, y), params)))


def reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, grads: list[dict]) -> None:
    """Plain torch: the mean of the groups' gradients (the fake's order of sums), then Adam's step."""
    for n, p in model.named_parameters():
        total = grads[0][n].clone()
        for theirs in grads[1:]:
            total += theirs[n]
        p.grad = total / GROUPS
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check_commit_step(path, run_ranks=None) -> list[str]:
    try:
        with switched_off(COMMIT_OFF, student=path):
            return _commit_problems(load(path).ft_step)
    except NotImplementedYet as e:
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - the student's error, on one line
        return [f"raised {type(e).__name__}: {e}"]


def _commit_problems(ft_step) -> list[str]:
    model, ref = Tiny(), Tiny()
    optimizer, ref_optimizer = torch.optim.Adam(model.parameters(), lr=LR), torch.optim.Adam(ref.parameters(), lr=LR)
    manager = FakeManager(model)
    optimizer.register_step_pre_hook(lambda *_: manager.log.append(("step",)))
    for step, fails in TRIES:
        shares = global_batch(step)
        grads = [group_grads(ref, x, y) for x, y in shares]  # at the weights the student's model should hold
        manager.start_quorum(grads[1:], fails)
        committed = attempt(ft_step, model, optimizer, shares[0], manager)
        label = f"step {step + 1}" + (" (the try that fails: its allreduce errs, should_commit() says False)"
                                      if fails else ", tried again" if (step, True) in TRIES else "")
        problems = _log_problems(label, manager, [n for n, _ in model.named_parameters()])
        problems += _left_problems(label, model)
        if not isinstance(committed, bool) or committed == fails:
            problems.append(f"{label}: ft_step returned {committed!r}; should_commit() said {not fails}")
        if not fails:
            reference_step(ref, ref_optimizer, grads)
        problems += _state_problems(label, model, optimizer, ref, ref_optimizer)
        if problems:
            return problems[:4]
    return []


def _log_problems(label: str, manager: FakeManager, names: list[str]) -> list[str]:
    """What the try's calls say: each gradient averaged once, the vote after them, the step after a yes."""
    log, problems = manager.log, []
    reduced = [n for event in log if event[0] == "allreduce" for n in event[1]]
    if any(event[0] == "allreduce" and not event[1] for event, work in zip(
            [e for e in log if e[0] == "allreduce"], manager.works) if work.tensor.numel() > 1):
        problems.append(f"{label}: manager.allreduce got a tensor that is none of the model's gradients (nor all "
                        "of them, flat, in model.parameters() order): average each p.grad itself")
    unwaited = [n for work in manager.works if not work.waited for n in work.names]
    if unwaited:
        problems.append(f"{label}: the allreduce of {unwaited} was never waited for: torchft divides by the groups "
                        "in the work's wait() (and reports an error there); without it p.grad holds their sum")
    missing = [n for n in names if n not in reduced]
    if missing:
        problems.append(f"{label}: the gradients of {missing} were not averaged over the replica groups: no "
                        "manager.allreduce of them (each group computed its own; every one must be the mean)")
    twice = [n for n in names if reduced.count(n) > 1]
    if twice:
        problems.append(f"{label}: the gradients of {twice} were all-reduced more than once, expected once each")
    votes = [i for i, event in enumerate(log) if event[0] == "should_commit"]
    steps = [i for i, event in enumerate(log) if event[0] == "step"]
    last_reduce = max((i for i, event in enumerate(log) if event[0] == "allreduce" and event[1]), default=-1)
    last_wait = max((i for i, event in enumerate(log) if event[0] == "wait" and event[1]), default=-1)
    if not votes:
        problems.append(f"{label}: manager.should_commit() was never asked: every rank of the replica group votes, "
                        "once a step, and the optimizer steps only on a yes")
    elif votes[0] < last_reduce:
        problems.append(f"{label}: manager.should_commit() was asked before the last manager.allreduce: vote after "
                        "the average, so that an error during it (a group lost) makes the vote False")
    elif votes[0] < last_wait:
        problems.append(f"{label}: manager.should_commit() was asked before the gradients' allreduces were waited "
                        "for: an allreduce reports its error in wait(), so a vote before it cannot hear of it")
    elif len(votes) > 1:
        problems.append(f"{label}: manager.should_commit() was asked {len(votes)} times: it is torchft's vote for "
                        "the step, to be called once per step (each call is a round of the commit protocol)")
    if steps and (not votes or steps[0] < votes[0]):
        problems.append(f"{label}: optimizer.step() ran before manager.should_commit() was asked: a step the "
                        "groups then do not commit has already changed the weights")
    elif steps and not all(log[v][1] for v in votes):
        problems.append(f"{label}: optimizer.step() ran although manager.should_commit() returned False: a step "
                        "not committed must change no weight and no optimizer state")
    return problems


def _left_problems(label: str, model: nn.Module) -> list[str]:
    left = [n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.ne(0).any())]
    return [f"{label}: when ft_step returned, the gradients of {left} were still there (p.grad neither None nor "
            "zero): the next try (or this step's retry) would add its gradient to them"] if left else []


def _state_problems(label: str, model, optimizer, ref, ref_optimizer) -> list[str]:
    """The weights and Adam's state against the reference's, each within 1e-12 (float64): a line for
    the weights that differ, one for the state."""
    weights, state = [], []
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if not _close(p.detach(), q.detach()):
            weights.append(f"{n} ({max_diff(p, q)})")
        mine, theirs = optimizer.state.get(p, {}), ref_optimizer.state.get(q, {})
        state += [f"{key} of {n} ({_state_diff(mine.get(key), theirs.get(key))})"
                  for key in sorted(set(mine) | set(theirs)) if not _close(mine.get(key), theirs.get(key))]
    why = (f"plain torch: the mean of the {GROUPS} groups' gradients, Adam's step on the tries that commit, none "
           "on the one that does not")
    return ([f"{label}: the weights differ from the reference's ({why}): " + ", ".join(weights)] if weights else []) \
        + ([f"{label}: Adam's state differs from the reference's: " + ", ".join(state)] if state else [])


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), rtol=1e-12, atol=1e-14)


def _state_diff(a, b) -> str:
    if a is None or b is None:
        return "missing" if a is None else "there, expected none yet"
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return f"{a.item():g}, expected {b.item():g}" if a.numel() == 1 else max_diff(a, b)
