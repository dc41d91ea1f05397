"""Data parallelism, written by hand: copies of the model that stay identical because their gradients do.

Chapter 2 of the course. Every dp rank holds the whole model and a different slice of the batch;
each steps on the mean of the ranks' gradients, the whole batch's, so copies that start equal
stay equal:

    rank 0: batch rows 0..B/2   -> grad g0 \
                                            all-reduce(sum) / dp -> (g0 + g1)/2 on both -> step
    rank 1: batch rows B/2..B   -> grad g1 /

As in PyTorch's DDP, gradients travel in buckets, each all-reduced asynchronously as soon as
backward has filled it, and not at all inside `no_sync()` (gradient accumulation). DataParallel
and ZeRO 1/2/3 (zero.py, zero3.py) are wrappers with one protocol, `GradSync` (no_sync,
finish_grad_sync, clip_and_step, optimizer, state_by_name, gathered), so the loop never asks
which it holds; what they share lives here (`bucket_params`, `clip_grads`, `GradSync`). Read
docs/02_data_parallel.md: the three tricks, the bytes, the protocol and why it is a wrapper.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from minipar.collectives import Group, all_reduce, broadcast
from minipar.mesh import Groups
from minipar.placement import DENSE, place, placement_of, sync_partial_grads


class Precision(Protocol):
    """What a wrapper asks of the precision policy it is handed (chapter 3b's precision.Precision): are the
    weights a `working` copy of masters it keeps (`mixed`), gradients sent in `reduce`? None: one dtype."""

    @property
    def mixed(self) -> bool: ...
    @property
    def working(self) -> torch.dtype: ...
    @property
    def reduce(self) -> torch.dtype: ...


def param_groups(model: nn.Module, cfg) -> list[dict]:
    """The optimizer's groups: weight decay (cfg.weight_decay) on matrices only, not on norm gains,
    as is usual for transformers."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def bucket_params(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive parameters (callers pass them in backward order) in chunks of about bucket_mb."""
    chunks, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.nbytes
        if size >= bucket_mb * 2**20:
            chunks.append(current)
            current, size = [], 0
    return chunks + [current] if current else chunks


def by_grad_mean(params: list[nn.Parameter]) -> dict[tuple[str, ...], list[nn.Parameter]]:
    """Parameters split by the dimensions their gradient is averaged over, order kept."""
    out: dict[tuple[str, ...], list[nn.Parameter]] = {}
    for p in params:
        out.setdefault(placement_of(p).grad_mean, []).append(p)
    return out


def clip_grads(grads: list[torch.Tensor], spread: list[tuple[Group, ...]], max_norm: float,
               stages: list[Group | None] | tuple = ()) -> float:
    """The global norm of `grads`, scaled in place to at most max_norm (0: no clipping); returns it.
    `spread[i]`: the groups whose ranks hold the other pieces of gradient i (tp or ep shards, ZeRO's
    flat slices), over which its squares are summed; one every rank holds whole is counted once. The total
    is then summed over `stages`, groups of ranks that hold different parameters (pp stages; None: one
    stage). As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1."""
    sq = grads[0].new_zeros(()) if grads else torch.zeros((), dtype=torch.float64)
    parts: dict[tuple[str, ...], tuple] = {}  # squares by the groups they are summed over
    for g, gs in zip(grads, spread):
        gs = tuple(x for x in gs if x.size > 1)
        parts.setdefault(tuple(x.name for x in gs), (gs, []))[1].append(g.pow(2).sum())
    for key in sorted(parts):  # sorted: every rank issues the same collectives in the same order
        gs, squares = parts[key]
        part = torch.stack(squares).sum()
        for group in gs:
            all_reduce(part, group)
        sq = sq + part
    for group in stages:
        all_reduce(sq, group or Group.solo("pp"))
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef)
    return float(norm)


def weak_hook(method):
    """A wrapper's bound method as a parameter's hook, without keeping the wrapper alive: a tensor
    keeps its hooks in C++, where Python's garbage collector cannot see the cycle parameter -> hook
    -> wrapper -> parameter, so a plain bound method would keep every wrapper (and its process
    groups) for as long as the process lives."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class GradBucket:
    """A few parameters whose gradients are averaged together, in one flat buffer of dtype `reduce`
    (None: the gradients' own; bf16-mixed may reduce its bf16 gradients in fp32)."""

    def __init__(self, index: int, params: list[nn.Parameter], group: Group, reduce: torch.dtype | None = None):
        self.index, self.params, self.group, self.reduce = index, params, group, reduce
        self.ready: set[int] = set()  # ids of params whose gradient is complete
        self.buffer: torch.Tensor | None = None
        self.work = None

    def launch(self) -> None:
        """Copy the gradients into the bucket's flat buffer, pre-divided by dp, and start its all-reduce."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.buffer is None:  # allocated once, reused every step
            self.buffer = torch.empty(sum(p.numel() for p in self.params), dtype=self.reduce or grads[0].dtype,
                                      device=grads[0].device)
        # --grad-reduce fp32: cat widens the bf16 gradients into the buffer, so the sum is rounded once, at the end
        torch.cat([g.reshape(-1) for g in grads], out=self.buffer)
        self.buffer.div_(self.group.size)
        self.work = all_reduce(self.buffer, self.group, async_op=True)

    def finish(self) -> None:
        """Wait for the all-reduce, then write the averaged gradients back into .grad."""
        self.ready.clear()
        if self.work is None:  # a group of one: the gradients are already the mean
            return
        self.work.wait()
        for p, averaged in zip(self.params, self.buffer.split([p.numel() for p in self.params])):
            if p.grad is None:
                p.grad = averaged.view_as(p).to(p.dtype, copy=True)
            else:
                p.grad.copy_(averaged.view_as(p))  # held in the weights' dtype, whatever the wire's
        self.work = None


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, master: dict | None = None) -> dict:
    """A torch optimizer's state by parameter name: {name: {slot: tensor}} (`master`: the tensor the
    optimizer steps for each parameter, if not the parameter itself)."""
    steps = {n: (master or {}).get(p, p) for n, p in model.named_parameters()}
    return {n: dict(optimizer.state[m]) for n, m in steps.items() if m in optimizer.state}


def set_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, states: dict,
                        master: dict | None = None) -> None:
    """The inverse of optimizer_state."""
    params = dict(model.named_parameters())
    for name, slots in states.items():
        for slot, value in slots.items():
            optimizer.state[(master or {}).get(params[name], params[name])][slot] = value


class GradSync(nn.Module):
    """What every gradient-sync wrapper shares (chapter 2 lists its protocol): it holds
    `module`, `optimizer` and the mesh's `groups`; `group` is the dense parameters' reduction group
    (dp, or dp x cp), over which each rank's share of the batch is counted (run/step.py)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    groups: Groups
    group: Group

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def gathered(self):
        """Every full weight present inside the block (for checkpoints). Only ZeRO-3 must gather."""
        yield

    def optimizer_state_bytes(self) -> int:
        return sum(t.nbytes for s in self.optimizer.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0)

    def sum_partial_grads(self, params: list[nn.Parameter]) -> None:
        """Add up, over its group, each gradient that its Placement says is a partial sum (chapter 4)."""
        for dim in sorted({d for p in params for d in placement_of(p).partial}):
            sync_partial_grads(params, self.groups[dim])

    @contextmanager
    def _holding(self, weights: dict[nn.Parameter, torch.Tensor]):
        """Inside the block each parameter shows the tensor `weights` gives it (bf16-mixed: its fp32
        master, for a checkpoint); its own data again after."""
        kept = {p: p.data for p in weights}
        for p, w in weights.items():
            p.data = w
        try:
            yield
        finally:
            for p, data in kept.items():
                p.data = data

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in weights, gradients and optimizer state, measured on its tensors."""
        return {"params": self.param_bytes(), "grads": self.gradient_bytes(), "optimizer": self.optimizer_state_bytes()}


class DataParallel(GradSync):
    """Wraps a model; averages each gradient during backward over the group its Placement names
    (`groups.reduction`: dp, dp x cp, or edp for experts).

    Usage per optimizer step:
        for i, micro_batch in enumerate(micro_batches):
            with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
                model(micro_batch).backward()
        model.finish_grad_sync()
        model.clip_and_step(max_norm, pp_group)
    """

    def __init__(self, module: nn.Module, groups: Groups, bucket_mb: float = 25.0,
                 optimizer: torch.optim.Optimizer | None = None, precision: Precision | None = None):
        super().__init__()
        self.module, self.groups, self.optimizer = module, groups, optimizer
        self.mixed = precision is not None and precision.mixed  # bf16-mixed: the policy build_grad_sync hands in
        self.reduce = precision.reduce if precision is not None and precision.mixed else None  # None: the grads'
        self.group = groups.reduction(DENSE)
        self.sync = True
        self.buckets = self._make_buckets([p for p in module.parameters() if p.requires_grad], bucket_mb)
        # Start identical: every copy takes rank 0's weights (and buffers).
        with torch.no_grad():
            for b in self.buckets:
                for p in b.params:
                    broadcast(p.data, b.group, src=0)
            for t in module.buffers():
                broadcast(t.data, self.group, src=0)
        # bf16-mixed: each parameter gets an fp32 master, a copy, which the optimizer (built on the model's
        # fp32 parameters) steps; the parameter becomes its bf16 working copy. Else each is its own master.
        self.master = {p: place(nn.Parameter(p.detach().clone()), placement_of(p)) if self.mixed else p
                       for p in module.parameters()}  # placed as its parameter: Muon gathers a tp shard's matrix
        if precision is not None and precision.mixed:
            for p in module.parameters():
                p.data = p.data.to(precision.working)
            for g in optimizer.param_groups if optimizer is not None else ():
                g["params"] = [self.master[p] for p in g["params"]]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_to_launch = 0
        self._grads_pending = False  # a backward ran since the last finish_grad_sync
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready))

    def _make_buckets(self, params: list[nn.Parameter], bucket_mb: float) -> list[GradBucket]:
        # Backward meets the last layers first; a bucket never mixes reduction groups.
        chunks = [(chunk, self.groups.reduction(dims)) for dims, ps in by_grad_mean(list(reversed(params))).items()
                  for chunk in bucket_params(ps, bucket_mb)]
        return [GradBucket(i, chunk, group, self.reduce) for i, (chunk, group) in enumerate(chunks)]

    @contextmanager
    def no_sync(self):
        """Backward inside this block accumulates gradients locally, with no communication."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _grad_ready(self, p: nn.Parameter) -> None:
        self._grads_pending = True
        bucket = self._bucket_of[id(p)]
        if not self.sync or bucket.group.size == 1:
            return
        if bucket.index < self._next_to_launch:
            # Its all-reduce is already in flight with the previous backward's gradient: averaging
            # now would silently drop this one. DDP allows it; we refuse it, loudly.
            raise RuntimeError("backward ran twice with gradient sync on before finish_grad_sync(): with "
                               "gradient accumulation, run all but the last micro-batch inside model.no_sync()")
        bucket.ready.add(id(p))
        # Launch in index order only, so every rank issues the same all-reduces in the same order.
        for b in self.buckets[self._next_to_launch :]:
            if len(b.ready) < len(b.params):
                break
            b.launch()
            self._next_to_launch += 1

    def finish_grad_sync(self) -> None:
        """Launch what backward did not, then wait for all: the buckets of parameters that got no
        gradient, or every bucket when all backwards ran inside no_sync() (a pipeline step's do: its
        micro-batches' backwards interleave with forwards, so it averages once at the very end)."""
        if all(b.group.size == 1 for b in self.buckets) or not self._grads_pending:
            return  # no backward since the last call: nothing to average
        self._grads_pending = False
        for bucket in self.buckets[self._next_to_launch :]:
            if bucket.group.size > 1:  # a group of one has its mean already: no flat copy for it
                bucket.launch()
        for bucket in self.buckets:
            bucket.finish()
        self._next_to_launch = 0

    def clip_and_step(self, max_norm: float, pp_group: Group | None = None, gate=None) -> float | None:
        """Sum the tp partial gradients, clip by the global norm (over tp and pp), step. bf16-mixed:
        the masters take fp32 copies of the gradients (the norm is an fp32 sum), and after the step
        the working weights take bf16 copies of the masters. `gate(grads)` first (run/step.py's
        StepHooks): False drops the gradients, steps nothing and returns None."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if gate is not None and not gate([p.grad for p in params]):
            for p in params:
                p.grad = None
            return None
        self.sum_partial_grads(list(self.module.parameters()))
        for p in params:
            self.master[p].grad = p.grad.to(self.master[p].dtype)  # the same tensor unless bf16-mixed
        grads = [self.master[p].grad for p in params]
        norm = clip_grads(grads, [self.groups.shards(placement_of(p)) for p in params], max_norm, [pp_group])
        if math.isfinite(norm):  # every rank has the same norm, so every rank skips a bad step alike
            self.optimizer.step()
            if self.mixed:
                for p, master in self.master.items():
                    p.data.copy_(master.detach())  # rounded to bf16
        self.optimizer.zero_grad(set_to_none=True)
        for p in params:
            p.grad = None
        return norm

    # -- the optimizer state by parameter name, and the weights (always whole here) --------------
    def state_by_name(self) -> dict:
        return optimizer_state(self.module, self.optimizer, self.master)

    def load_state_by_name(self, states: dict) -> None:
        set_optimizer_state(self.module, self.optimizer, states, self.master)

    @contextmanager
    def gathered(self):
        """The weights are whole here; bf16-mixed shows the fp32 masters (what a checkpoint saves)."""
        with self._holding({p: m.detach() for p, m in self.master.items()} if self.mixed else {}):
            yield

    def param_bytes(self) -> int:
        """The weights, and bf16-mixed's fp32 masters."""
        weights = sum(p.nbytes for p in self.module.parameters())
        return weights + sum(m.nbytes for p, m in self.master.items() if m is not p)

    def gradient_bytes(self) -> int:
        """A full gradient per parameter, plus the flat bucket buffers (kept between steps)."""
        grads = sum(p.nbytes for p in self.module.parameters())
        return grads + sum(b.buffer.nbytes for b in self.buckets if b.buffer is not None)
