"""Data parallelism, written by hand: replicas that stay identical because their gradients do.

Chapter 2 of the course. Every dp rank holds the whole model and a different slice of the batch.
If the replicas start equal and apply the same update, they stay equal; the update is the same
when every rank uses the gradient of the *whole* batch, the mean of the ranks' gradients:

    rank 0: batch rows 0..B/2   -> grad g0 \
                                            all-reduce(sum) / dp -> (g0 + g1)/2 on both -> step
    rank 1: batch rows B/2..B   -> grad g1 /

Three ideas make it fast, as in PyTorch's DDP:

1. Buckets. One all-reduce per parameter would pay the latency of a collective hundreds of
   times; one for the whole model would wait for the whole backward. Parameters are grouped in
   ~`bucket_mb` buckets, in reverse order of definition (roughly the order backward produces
   their gradients).
2. Overlap. A hook on each parameter fires when its gradient is complete. When every gradient
   of a bucket is ready, its all-reduce starts asynchronously, while backward goes on computing
   the earlier layers. `finish_grad_sync()` waits for the last ones. Buckets are launched in
   index order on every rank, so all ranks issue the same collectives in the same order.
3. No sync while accumulating. With gradient accumulation over k micro-batches, the gradients
   of the first k-1 need not be averaged: summing locally and averaging once gives the same
   result with 1/k of the traffic. Inside `with model.no_sync():` the hooks stand aside.

Traffic per optimizer step: one all-reduce of every gradient, 2 (dp-1)/dp * 4 * Psi bytes per
rank in float32 for Psi parameters (the ledger shows it under "dp/all_reduce").
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from minipar.collectives import Group, all_reduce, broadcast


class GradBucket:
    """A few parameters whose gradients are averaged together, in one flat buffer."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.ready: set[int] = set()  # ids of params whose gradient is complete
        self.buffer: torch.Tensor | None = None
        self.work = None

    def launch(self, group: Group) -> None:
        """Copy the gradients into the bucket's flat buffer, pre-divided by dp, and start its all-reduce."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.buffer is None:  # allocated once, reused every step
            self.buffer = torch.empty(sum(p.numel() for p in self.params), dtype=grads[0].dtype,
                                      device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=self.buffer).div_(group.size)
        self.work = all_reduce(self.buffer, group, async_op=True)

    def finish(self) -> None:
        """Wait for the all-reduce, then write the averaged gradients back into .grad."""
        self.work.wait()
        offset = 0
        for p in self.params:
            averaged = self.buffer[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = averaged.clone()
            else:
                p.grad.copy_(averaged)
            offset += p.numel()
        self.work = None
        self.ready.clear()


class DataParallel(nn.Module):
    """Wraps a model; averages its gradients over `group` during backward.

    Usage per optimizer step:
        for i, micro_batch in enumerate(micro_batches):
            with model.no_sync() if i < len(micro_batches) - 1 else nullcontext():
                model(micro_batch).backward()
        model.finish_grad_sync()
        optimizer.step()
    """

    def __init__(self, module: nn.Module, group: Group, bucket_mb: float = 25.0):
        super().__init__()
        self.module = module
        self.group = group
        self.sync = True
        # Start identical: every replica takes rank 0's weights (and buffers).
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                broadcast(t.data, group, src=0)
        self.buckets = self._make_buckets([p for p in module.parameters() if p.requires_grad], bucket_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_to_launch = 0
        self._grads_pending = False  # a backward ran since the last finish_grad_sync
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], bucket_mb: float) -> list[GradBucket]:
        buckets, current, size = [], [], 0
        limit = bucket_mb * 2**20
        for p in reversed(params):  # backward meets the last layers first
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                buckets.append(GradBucket(len(buckets), current))
                current, size = [], 0
        if current:
            buckets.append(GradBucket(len(buckets), current))
        return buckets

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

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
        if not self.sync or self.group.size == 1:
            return
        bucket = self._bucket_of[id(p)]
        if bucket.index < self._next_to_launch:
            # Its all-reduce is already in flight with the previous backward's gradient: averaging
            # now would silently drop this one. DDP allows it; we refuse it, loudly.
            raise RuntimeError(
                "backward ran twice with gradient sync on before finish_grad_sync(): with gradient "
                "accumulation, run all but the last micro-batch inside model.no_sync()"
            )
        bucket.ready.add(id(p))
        # Launch in index order only, so every rank issues the same all-reduces in the same order.
        while (
            self._next_to_launch < len(self.buckets)
            and len(self.buckets[self._next_to_launch].ready) == len(self.buckets[self._next_to_launch].params)
        ):
            self.buckets[self._next_to_launch].launch(self.group)
            self._next_to_launch += 1

    def finish_grad_sync(self) -> None:
        """Launch what backward did not, then wait for all.

        "What backward did not" is the buckets of parameters that got no gradient, or every bucket
        when all backwards ran inside no_sync() (as a pipeline step does: its micro-batches'
        backwards interleave with forwards, so it averages once at the very end).
        """
        if self.group.size == 1 or not self._grads_pending:
            return  # no backward since the last call: nothing to average
        self._grads_pending = False
        for bucket in self.buckets[self._next_to_launch :]:
            bucket.launch(self.group)
        for bucket in self.buckets:
            bucket.finish()
        self._next_to_launch = 0
