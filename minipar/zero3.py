"""ZeRO stage 3: the weights are sharded too, and each layer is gathered only while it is used.

Chapter 3 of the course, second half. After stages 1 and 2, every rank still holds all the
weights. Stage 3 keeps only this rank's 1/N slice of each layer's (flat, padded) weights, and
rebuilds the full layer just in time, twice per step:

    forward:   all-gather layer i  -> run it -> free its full weights   (and start layer i+1's
                                                                          all-gather: prefetch)
    backward:  all-gather layer i  -> its backward -> reduce-scatter its gradients -> free both
                                                                        (prefetch layer i-1)

so outside the layer in use a rank holds 1/N of the weights. The price is one more all-gather:
3 (N-1)/N Psi bytes per step instead of 2 (the ZeRO paper's 3 Psi).

How a layer's weights come and go. Each parameter is a view into one flat buffer per bucket (a
bucket: a layer's parameters of one kind, as in zero.py). Freeing resizes the buffer's storage
to zero bytes; gathering resizes it back and all-gathers the slices into it. The parameters, and
every tensor autograd saved that points at them, see the weights reappear without being replaced;
the gather writes through `.data`, a second handle on the same memory that does not count as a
change to the saved tensors.

When. A forward pre-hook on each layer gathers it (and prefetches the next), a forward post-hook
frees it and hooks the layer's output, so that the moment backward reaches that output the layer is
gathered again (and the previous one prefetched). Each parameter's post-accumulate-grad hook
reduce-scatters a bucket once all its gradients are in (stage 2's mechanism), then frees it.

Stage 3 and pipeline parallelism fit poorly: a pipeline runs each stage's forward and backward
once per micro-batch, interleaved, so the layers would be gathered 2m times per step instead of
twice. minipar refuses the combination (as it refuses stage 3 with --recompute, whose second
forward during backward these hooks do not follow).

ZeRO++ (zeropp.py, `zeropp=`) changes only how a bucket's messages travel: the forward gather in
int8 (qwZ), the backward gather from a second shard inside the node (hpZ), the gradients through
two quantized all-to-alls (qgZ). Without it, every message is the plain one above.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from minipar.collectives import Group, all_gather_into
from minipar.mesh import Groups
from minipar.precision import FULL, Precision
from minipar.zero import ZeroBucket, ZeroDataParallel
from minipar.zeropp import QuantizedGather, ZeroPP, quantized_reduce_scatter


def units_of(model: nn.Module) -> list[nn.Module]:
    """The model's top-level modules that hold parameters, in forward order (the embedding, each
    transformer layer, the final norm, the LM head): what stage 3 gathers and frees as a whole."""
    units = []
    for child in model.children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            units += [m for m in child.children() if any(True for _ in m.parameters())]
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


def unit_chunks(units: list[nn.Module], params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """ZeRO-3's buckets of `params`: one per unit, last unit first (backward's order)."""
    ids, chunks = {id(p) for p in params}, []
    for unit in reversed(units):  # a weight two units share (tied embeddings) goes with the later one
        chunks.append([p for p in unit.parameters() if id(p) in ids])
        ids -= {id(p) for p in chunks[-1]}
    return [c for c in chunks if c]


class ShardedBucket(ZeroBucket):
    """A ZeRO bucket whose parameters are views into a flat buffer that exists only when gathered.
    `shard`: the slice it gathers from: the master itself, or under bf16-mixed its bf16 copy (so the
    all-gather sends bf16, and the copy is made once per step, not once per gather).
    `plus` (ZeRO++): hpZ adds `secondary`, this rank's 1/K of the whole bucket inside its node."""

    def __init__(self, params: list[nn.Parameter], group: Group, spread: tuple[Group, ...],
                 precision: Precision = FULL, plus: ZeroPP | None = None):
        super().__init__(params, group, spread, precision=precision)  # parameters: views into self.full [padded]
        self.shard = self.master.detach().to(self.full.dtype)  # [padded / N]; the master when of one dtype
        self.plus, self.secondary, self.refresh = plus or ZeroPP(), None, False
        if self.plus.hpz:  # place j of K on the node keeps elements [j P/K, (j+1) P/K) of the bucket
            k, j = self.plus.intra.size, self.plus.intra.rank
            self.node_slice = slice(j * self.padded // k, (j + 1) * self.padded // k)
            self.secondary = torch.zeros(self.padded // k, dtype=self.full.dtype, device=self.full.device)  # [P/K]
        self.work: Any = None  # the gather in flight: a torch work handle, or qwZ's QuantizedGather
        self.free()

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)  # still shaped [padded], now 0 bytes behind it

    def start_gather(self, phase: str = "exact") -> None:
        """phase: "forward", "backward" (ZeRO++ sends these its own ways) or "exact" (the masters' weights)."""
        if self.full.untyped_storage().nbytes() > 0:
            return  # gathered, or on its way
        self.full.untyped_storage().resize_(self.padded * self.full.element_size())  # [padded] again
        if phase == "backward" and self.secondary is not None:  # hpZ: from the node's copy, over the node
            self.work = all_gather_into(self.full.data, self.secondary, self.plus.intra, async_op=True)  # K x [P/K]
        elif phase == "forward" and self.plus.qwz:  # qwZ: int8 codes and scales, dequantized on arrival
            self.work = QuantizedGather(self.full.data, self.shard, self.group, self.plus.weight_bits, self.plus.block)
        else:
            self.work = all_gather_into(self.full.data, self.shard, self.group, async_op=True)  # N x [padded // N]
        self.refresh = phase == "forward" and self.secondary is not None

    def gather(self, phase: str = "exact") -> None:
        self.start_gather(phase)
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.refresh:  # hpZ: a forward gather of this step's weights fills the node's copy (no bytes)
            self.secondary.copy_(self.full.data[self.node_slice])
            self.refresh = False

    def _reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        if not self.plus.qgz:
            return super()._reduce_scatter(flat)
        return quantized_reduce_scatter(flat, self.plus.intra, self.plus.cross, self.plus.grad_bits, self.plus.block)


class Zero3DataParallel(ZeroDataParallel):
    """ZeRO-3 over the dp group. `units`: the modules gathered as a whole (default: units_of)."""

    STAGES = (3,)

    def __init__(self, module: nn.Module, groups: Groups, make_optimizer, param_groups, units=None,
                 precision: Precision = FULL, zeropp: tuple[str, ...] = ()):
        self._units = units if units is not None else units_of(module)  # plain list: set before Module init
        if {"hpz", "qgz"} & set(zeropp) and groups.dp_intra.size * groups.dp_cross.size != groups.dp.size:
            raise ValueError(f"ZeRO++ {','.join(zeropp)}: hpz and qgz need the dp group split by node "
                             "(mesh.split_dp_by_node() before mesh.groups())")
        self._plus = ZeroPP(tuple(zeropp), groups.dp_intra, groups.dp_cross)  # plain object: before Module init
        super().__init__(module, groups, 3, make_optimizer, param_groups, 0.0, precision=precision)
        self._unit_buckets = [[b for b in self.buckets if id(b.params[0]) in {id(p) for p in u.parameters()}]
                              for u in self._units]
        for i, unit in enumerate(self._units):
            unit.register_forward_pre_hook(lambda mod, args, i=i: self._before(i, step=1))
            unit.register_forward_hook(lambda mod, args, out, i=i: self._after_forward(i, out))

    # Buckets: one per unit and kind of parameter, never spanning two units.
    def _new_bucket(self, params, group: Group, spread: tuple[Group, ...]) -> ShardedBucket:
        if group is not self.groups.dp and {"hpz", "qgz"} & set(self._plus.options):
            raise ValueError(f"ZeRO++ hpz and qgz split the dp group by node; these parameters are reduced over "
                             f"{group.name} (cp or experts): use qwz alone")
        return ShardedBucket(params, group, spread, self.precision, self._plus)

    def _chunks(self, params, bucket_mb):
        return unit_chunks(self._units, params)

    def _before(self, i: int, step: int) -> None:
        """Gather unit i now; start gathering the unit that runs next (i+1 forward, i-1 backward)."""
        phase = "forward" if step == 1 else "backward"
        for b in self._unit_buckets[i]:
            b.gather(phase)
        if 0 <= i + step < len(self._units):
            for b in self._unit_buckets[i + step]:
                b.start_gather(phase)

    def _after_forward(self, i: int, out) -> None:
        for b in self._unit_buckets[i]:
            b.free()
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before(i, step=-1))

    def _bucket_done(self, bucket) -> None:
        bucket.free()  # its gradients are reduce-scattered, so its backward is over: the weights go too

    def clip_and_step(self, max_norm: float, pp_group: Group | None = None) -> float:
        """As stages 1-2, but no all-gather after the step: each layer is gathered when next used."""
        for b in self.buckets:  # a prefetch that ran past the last unit must not outlive the step
            if b.work is not None:
                b.gather()
            b.free()
        return super().clip_and_step(max_norm, pp_group)

    def _after_step(self) -> None:
        """No all-gather: each layer is gathered when it is next used. bf16-mixed: the bf16 shards
        take the updated masters."""
        if self.precision.mixed:
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
