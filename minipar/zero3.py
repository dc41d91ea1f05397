"""ZeRO stage 3 (chapter 3, second half): the weights sharded too, each layer gathered while used.

    forward:   all-gather layer i  -> run it -> free its full weights   (prefetch layer i+1)
    backward:  all-gather layer i  -> its backward -> reduce-scatter its gradients -> free both

3 (N-1)/N Psi bytes a step instead of 2. A bucket's `Transport` sends its messages (ZeRO++: zeropp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from minipar.collectives import Group, all_gather_into, reduce_scatter
from minipar.data_parallel import Precision
from minipar.mesh import Groups
from minipar.zero import ZeroBucket, ZeroDataParallel


def units_of(model: nn.Module) -> list[nn.Module]:
    """The model's top-level modules that hold parameters, in forward order (the embedding, each
    transformer layer, the final norm, the LM head): what stage 3 gathers and frees as a whole."""
    layers = (nn.ModuleDict, nn.ModuleList)  # each module inside is a unit of its own
    modules = [m for child in model.children() for m in (child.children() if isinstance(child, layers) else [child])]
    return [m for m in modules if any(True for _ in m.parameters())]


def unit_chunks(units: list[nn.Module], params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """ZeRO-3's buckets of `params`: one per unit, last unit first (backward's order)."""
    ids, chunks = {id(p) for p in params}, []
    for unit in reversed(units):  # a weight two units share (tied embeddings) goes with the later one
        chunks.append([p for p in unit.parameters() if id(p) in ids])
        ids -= {id(p) for p in chunks[-1]}
    return [c for c in chunks if c]


class Transport:
    """How a bucket's messages travel: plainly, all-gathers into bucket.full and reduce-scatters."""

    def prepare(self, bucket: ShardedBucket) -> None:  # once, when the bucket is made
        pass

    def gather_exact(self, bucket: ShardedBucket) -> Any:  # the shards as they are (checkpoints, step's end)
        return all_gather_into(bucket.full.data, bucket.shard, bucket.group, async_op=True)  # N x [padded // N]

    def gather_forward(self, bucket: ShardedBucket) -> Any:  # before a unit's forward
        return self.gather_exact(bucket)

    def gather_backward(self, bucket: ShardedBucket) -> Any:  # before a unit's backward
        return self.gather_exact(bucket)

    def reduce_scatter(self, bucket: ShardedBucket, flat: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(flat, bucket.group)  # [padded] -> [padded // N]

    def held(self, bucket: ShardedBucket) -> list[torch.Tensor]:  # what it keeps beyond the shard
        return []


class ShardedBucket(ZeroBucket):
    """A ZeRO bucket whose flat buffer exists only when gathered. `shard`: what it gathers from (the
    master, or under bf16-mixed its bf16 copy, made once a step); `transport` sends its messages."""

    def __init__(self, params: list[nn.Parameter], group: Group, spread: tuple[Group, ...],
                 precision: Precision | None = None, transport: Transport | None = None, whole: bool = False):
        super().__init__(params, group, spread, precision=precision, whole=whole)  # views into self.full [padded]
        self.shard = self.master.detach().to(self.full.dtype)  # [padded / N]; the master when of one dtype
        self.transport = transport or Transport()
        self.work: Any = None  # the gather in flight
        self.transport.prepare(self)
        self.free()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)  # still shaped [padded], now 0 bytes behind it

    def start_gather(self, send: Callable[[ShardedBucket], Any] | None = None) -> None:
        """send: the transport's gather_forward or gather_backward; by default its gather_exact."""
        if self.full.untyped_storage().nbytes() == 0:  # else gathered, or on its way
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())  # [padded] again
            self.work = (send or self.transport.gather_exact)(self)

    def gather(self, send: Callable[[ShardedBucket], Any] | None = None) -> None:
        self.start_gather(send)
        if self.work is not None:
            self.work.wait()
            self.work = None

    def _reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        return self.transport.reduce_scatter(self, flat)

    def held(self) -> list[torch.Tensor]:
        return [self.master, self.shard, *self.transport.held(self)]


class Zero3DataParallel(ZeroDataParallel):
    """ZeRO-3 over the dp group. `units`: the modules gathered as a whole (default: units_of);
    `transport`: how every bucket's messages travel (default: the plain Transport)."""

    STAGES = (3,)

    def __init__(self, module: nn.Module, groups: Groups, make_optimizer, param_groups, units=None,
                 precision: Precision | None = None, transport: Transport | None = None):
        self._units = units if units is not None else units_of(module)  # plain list: set before Module init
        self._transport = transport or Transport()  # plain object: before Module init
        super().__init__(module, groups, 3, make_optimizer, param_groups, 0.0, precision=precision)
        self._unit_buckets = [[b for b in self.buckets if id(b.params[0]) in {id(p) for p in u.parameters()}]
                              for u in self._units]
        for i, unit in enumerate(self._units):
            unit.register_forward_pre_hook(lambda mod, args, i=i: self._before(i, step=1))
            unit.register_forward_hook(lambda mod, args, out, i=i: self._after_forward(i, out))

    # Buckets: one per unit and kind of parameter, never spanning two units.
    def _new_bucket(self, params, group: Group, spread: tuple[Group, ...], whole: bool = False) -> ShardedBucket:
        return ShardedBucket(params, group, spread, self.precision, self._transport, whole)

    def _chunks(self, params, bucket_mb):
        return unit_chunks(self._units, params)

    def _before(self, i: int, step: int) -> None:
        """Gather unit i now; start gathering the unit that runs next (i+1 forward, i-1 backward)."""
        send = self._transport.gather_forward if step == 1 else self._transport.gather_backward
        for b in self._unit_buckets[i]:
            b.gather(send)
        if 0 <= i + step < len(self._units):
            for b in self._unit_buckets[i + step]:
                b.start_gather(send)

    def _after_forward(self, i: int, out) -> None:
        for b in self._unit_buckets[i]:
            b.free()
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before(i, step=-1))

    def _bucket_done(self, bucket) -> None:
        bucket.free()  # its gradients are reduce-scattered, so its backward is over: the weights go too

    def clip_and_step(self, max_norm: float, pp_group: Group | None = None, gate=None) -> float | None:
        """As stages 1-2, but no all-gather after the step: each layer is gathered when next used."""
        self._settle()
        return super().clip_and_step(max_norm, pp_group, gate)

    def _settle(self) -> None:
        for b in self.buckets:  # a prefetch that ran past the last unit must not outlive the step
            if b.work is not None:
                b.gather()
            b.free()

    def _after_step(self) -> None:
        """No all-gather (see clip_and_step); bf16-mixed: the bf16 shards take the updated masters."""
        if self.mixed:
            for b in self.buckets:
                b.shard.copy_(b.master.detach())

    @contextmanager
    def _gathered_working(self):
        for b in self.buckets:
            b.gather()
        try:
            yield
        finally:
            for b in self.buckets:
                b.free()
