"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients, across the dp group.

Chapter 3 of the course. Data parallelism keeps N identical copies of the optimizer state, 3/4 of
the memory in mixed precision; ZeRO (Rajbhandari et al., 2020) gives each rank one N-th of it:

    flat parameters, in buckets      [ bucket 0            ][ bucket 1            ] ...
    each bucket cut in N slices      [ r0 | r1 | r2 | r3  ][ r0 | r1 | r2 | r3  ]
    rank r owns slice r of each bucket: its optimizer state, its master weights, its gradients

    stage 1  optimizer state sharded. After backward: reduce-scatter the gradients (each rank
             receives the sum of its own slice), update the slice, all-gather the new weights.
    stage 2  gradients sharded too. Each bucket is reduce-scattered *during* backward, as soon
             as its gradients are complete, and the full gradients are freed right away.

The same 2 (N-1)/N Psi bytes per step as data parallelism's all-reduce. Stage 2 reduce-scatters
every micro-batch (`no_sync()` cannot keep full gradients). Stage 3 is the subclass in zero3.py.
Read docs/03_zero.md: the bytes, accumulation, clipping, tp, and CPU offload (`offload=True`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from minipar.collectives import Group, all_gather, all_gather_into, broadcast, reduce_scatter
from minipar.data_parallel import GradSync, Precision, bucket_params, by_grad_mean, clip_grads, weak_hook
from minipar.mesh import Groups
from minipar.placement import DENSE, placement_of


def bucket_plan(param_groups: list[dict], chunks) -> list[tuple[int, tuple[str, ...], list[nn.Parameter]]]:
    """ZeRO's buckets, before any is made: (optimizer group index, grad_mean dimensions, params). A
    bucket never mixes weight-decay settings, parameters cut over different mesh dimensions (tp, ep),
    nor reduction groups: each slice then has one decay, one group, and knows over which groups its
    norm adds up. `chunks(params)` cuts a run of parameters into buckets. Pure: the estimator
    (estimate.py) plans the same buckets on parameters that hold no memory."""
    plan = []
    for i, pg in enumerate(param_groups):
        for cut in sorted({tuple(d for d, _ in placement_of(p).shards) for p in pg["params"]}):
            params = [p for p in pg["params"] if tuple(d for d, _ in placement_of(p).shards) == cut]
            for dims, same_group in by_grad_mean(list(reversed(params))).items():
                plan += [(i, dims, chunk) for chunk in chunks(same_group)]
    return plan


def model_state_bytes(psi: float, n: int, stage: int, weight: float = 2, grad: float = 2, k: float = 12) -> float:
    """The ZeRO paper's per-rank bytes of model states: psi parameters over n data-parallel ranks,
    `weight` and `grad` bytes per parameter and K bytes of optimizer state (mixed-precision Adam:
    2 + 2 + 12). Stage 1 divides the optimizer state by n, stage 2 the gradients too, stage 3 all."""
    return psi * (weight / (n if stage >= 3 else 1) + grad / (n if stage >= 2 else 1) + k / (n if stage >= 1 else 1))


def packed(sizes: list[int], n: int) -> tuple[list[int], int]:
    """(where each parameter starts, the flat size): one after another, padded to a multiple of n."""
    return [sum(sizes[:i]) for i in range(len(sizes))], -(-sum(sizes) // n) * n


def kept_whole(sizes: list[int], n: int) -> tuple[list[int], int]:
    """As `packed`, but no parameter is cut: at most n runs of consecutive parameters, the largest run
    (S) as small as can be, run r at r x S. A slice is then whole parameters and padding (uneven)."""
    def runs(most: int) -> list[int]:  # where each run begins, when a run holds at most `most`
        begins, total = [0], 0
        for i, size in enumerate(sizes):
            if total + size > most:
                begins.append(i)
                total = 0
            total += size
        return begins

    low, high = max(sizes), sum(sizes)
    while low < high:  # bisect for the smallest S that n runs can hold
        mid = (low + high) // 2
        if len(runs(mid)) <= n:
            high = mid
        else:
            low = mid + 1
    begins, offsets, run, at = runs(low), [], -1, 0
    for i, size in enumerate(sizes):
        if i in begins:  # the next run, at the next rank's slice
            run += 1
            at = run * low
        offsets.append(at)
        at += size
    return offsets, n * low


class ZeroBucket:
    """Some parameters as one flat vector, padded to a multiple of N; this rank owns 1/N of it. The
    parameters become views into that flat vector (`full`), so the all-gather after the step writes
    the new weights straight into them, with no copy. `master`: this rank's slice in fp32 (float64
    stays float64), what the optimizer updates; `grad_slice`: its gradient, in the weights' dtype.
    bf16-mixed: `full` (and the gradients) become bf16 once the master is taken. `whole`: slices end
    only between parameters (`kept_whole`: Muon's matrices, chapter 4c)."""

    def __init__(self, params: list[nn.Parameter], group: Group, spread: tuple[Group, ...] = (),
                 offload: bool = False, precision: Precision | None = None, whole: bool = False):
        self.params, self.group = params, group
        self.reduce: torch.dtype | None = None  # the gradients' own dtype, unless bf16-mixed (below)
        # Where the rest of this bucket's gradient lives, for a norm over the whole of it: other tp or
        # ep shards of these same parameters (`spread`), and the other dp ranks' slices (`group`).
        self.spread = spread + (group,)
        self.offsets, self.padded = (kept_whole if whole else packed)([p.numel() for p in params], group.size)
        # Rank r owns elements [r * padded/N, (r+1) * padded/N): e.g. numel 10, N 4: padded 12, slices of 3.
        self.slice = slice(group.rank * self.padded // group.size, (group.rank + 1) * self.padded // group.size)
        self.full = self._flatten([p.detach() for p in params])  # [padded]
        dtype = torch.promote_types(self.full.dtype, torch.float32)
        device = "cpu" if offload else self.full.device  # CPU offload: state and update live in host memory
        self.master = nn.Parameter(self.full[self.slice].to(device=device, dtype=dtype).clone())  # [padded // N]
        self.master.bucket = self  # what it is a slice of: Muon (chapter 4c) gathers the whole matrices
        if precision is not None and precision.mixed:  # chapter 3b's policy, handed in by parallelize
            self.full = self.full.to(precision.working)  # the working weights: bf16
            self.reduce = precision.reduce
        for p, view in zip(params, self.views(self.full)):
            p.data = view
        self.grad_slice: torch.Tensor | None = None
        self.ready: set[int] = set()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat [padded] vector seen as this bucket's parameters, in order, without copies."""
        return [flat[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]

    def _flatten(self, tensors) -> torch.Tensor:
        flat = tensors[0].new_zeros(self.padded)  # [padded], zeros where no parameter is
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)
        return flat

    def reduce_scatter_grads(self) -> None:
        """Add this rank's slice of the dp-mean of the bucket's gradients to grad_slice; free them."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flatten(grads).to(self.reduce or self.full.dtype)  # [padded]; --grad-reduce fp32: twice the bytes
        mine = self._reduce_scatter(flat.div_(self.group.size)).to(self.master.device, self.full.dtype)  # [padded // N]
        # Accumulation (stage 2): one reduce-scatter per micro-batch, each added to the slice.
        self.grad_slice = mine if self.grad_slice is None else self.grad_slice.add_(mine)
        for p in self.params:
            p.grad = None  # the full gradient is gone: only the slice remains
        self.ready.clear()

    def _reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        return reduce_scatter(flat, self.group)  # ZeRO-3's buckets: as their transport sends it (zero3.py)

    def held(self) -> list[torch.Tensor]:
        """What the bucket keeps beside the model's parameters: this rank's master slice."""
        return [self.master]

    def all_gather_params(self) -> None:
        """Every rank's updated slice (N x [padded // N], in rank order) gathered straight into the
        parameters' flat vector, through `.data`: a second handle on the same memory, which autograd
        does not count as an in-place change of the parameters."""
        all_gather_into(self.full.data, self.master.detach().to(self.full.device, self.full.dtype), self.group)


class ZeroDataParallel(GradSync):
    """Wraps a model like DataParallel; owns the optimizer, which sees only this rank's slices:
    `make_optimizer(param_groups)` builds it (AdamW) on the master slices, a group per weight decay."""

    STAGES: tuple[int, ...] = (1, 2)  # stage 3 is zero3.Zero3DataParallel, a subclass

    def __init__(self, module: nn.Module, groups: Groups, stage: int, make_optimizer, param_groups,
                 bucket_mb: float = 25.0, offload: bool = False, precision: Precision | None = None):
        super().__init__()
        if stage not in self.STAGES:
            raise ValueError(f"ZeRO stage {stage} is not built by {type(self).__name__}: choose from {self.STAGES}")
        self.module, self.groups, self.stage, self.offload, self.precision = module, groups, stage, offload, precision
        self.mixed = precision is not None and precision.mixed  # bf16 weights, fp32 masters (chapter 3b)
        self.group = groups.reduction(DENSE)  # the dense parameters' group
        with torch.no_grad():  # start identical, as in DataParallel
            for p in module.parameters():
                broadcast(p.data, groups.reduction(placement_of(p).grad_mean), src=0)
        self.buckets: list = []  # ZeroBucket, or ZeRO-3's ShardedBucket
        masters: list[list[nn.Parameter]] = [[] for _ in param_groups]
        for i, dims, chunk in bucket_plan(param_groups, lambda params: self._chunks(params, bucket_mb)):
            whole = param_groups[i].get("keep_whole", False)  # an optimizer that needs whole matrices asks
            bucket = self._new_bucket(chunk, groups.reduction(dims), groups.shards(placement_of(chunk[0])), whole)
            self.buckets.append(bucket)
            masters[i].append(bucket.master)
        self.optimizer = make_optimizer([{**{k: v for k, v in pg.items() if k != "params"}, "params": ms}
                                         for pg, ms in zip(param_groups, masters)])
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        if stage >= 2:
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready))

    def _new_bucket(self, params, group: Group, spread: tuple[Group, ...], whole: bool = False) -> ZeroBucket:
        return ZeroBucket(params, group, spread, self.offload, self.precision, whole)

    def _chunks(self, params, bucket_mb):
        return bucket_params(params, bucket_mb)

    @contextmanager
    def no_sync(self):
        """Stage 1 communicates only in finish_grad_sync anyway: full gradients accumulate locally.
        Stage 2 reduce-scatters every micro-batch regardless (see the module docstring)."""
        yield

    def _grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):  # stage 2: reduce-scatter now, free the full grads
            self.sum_partial_grads(bucket.params)  # tp partial sums first
            bucket.reduce_scatter_grads()
            self._bucket_done(bucket)

    def _bucket_done(self, bucket) -> None:
        """Called once a bucket's gradients are reduce-scattered during backward (stage 3 frees it)."""

    def finish_grad_sync(self) -> None:
        """Reduce-scatter whatever backward has not (all of it in stage 1)."""
        for bucket in self.buckets:
            if any(p.grad is not None for p in bucket.params):
                self.sum_partial_grads(bucket.params)  # tp partial sums first
                bucket.reduce_scatter_grads()

    def clip_and_step(self, max_norm: float, pp_group: Group | None = None, gate=None) -> float | None:
        """Global gradient norm from the slices (summed over dp; tp-sharded buckets also over tp;
        stages over pp), clipping, the optimizer step on the slices, and the all-gather of weights.
        bf16-mixed: each gradient slice is copied to fp32 for the norm and AdamW, for the step only.
        `gate(slices)` first, as DataParallel's: False drops them and returns None."""
        with_grad = [b for b in self.buckets if b.grad_slice is not None]
        if gate is not None and not gate([b.grad_slice for b in with_grad]):
            for b in self.buckets:
                b.master.grad = b.grad_slice = None
            return None
        for b in with_grad:
            b.master.grad = b.grad_slice.to(b.master.dtype)  # the same tensor unless bf16-mixed
        norm = clip_grads([b.master.grad for b in with_grad], [b.spread for b in with_grad], max_norm, [pp_group])
        if math.isfinite(norm):  # a diverging step is skipped on every rank alike
            self.optimizer.step()
        for b in self.buckets:
            b.master.grad = b.grad_slice = None  # between steps a rank holds no gradient at all
        if math.isfinite(norm):
            self._after_step()
        return norm

    def _after_step(self) -> None:
        """Stages 1-2: every rank needs all the new weights: all-gather the updated slices."""
        for b in self.buckets:
            b.all_gather_params()

    @contextmanager
    def gathered(self):
        """Every full weight present inside the block; bf16-mixed: the fp32 masters, all-gathered
        (what a checkpoint saves, so that a resumed run starts from the very same weights)."""
        if not self.mixed:
            with self._gathered_working():
                yield
            return
        weights = {}
        for b in self.buckets:
            flat = torch.empty(b.padded, dtype=b.master.dtype, device=b.full.device)  # [padded], fp32
            all_gather_into(flat, b.master.detach().to(b.full.device), b.group)
            weights.update(zip(b.params, b.views(flat)))
        with self._holding(weights):
            yield

    @contextmanager
    def _gathered_working(self):
        yield  # stages 1-2 hold every weight (ZeRO-3 gathers)

    # -- checkpoints: the optimizer state by parameter name, as an unsharded optimizer would hold it --
    def state_by_name(self) -> dict:
        """{name: {slot: tensor}} with every dp rank's slices joined (a collective over dp)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out: dict[str, dict] = {}
        for b in self.buckets:
            for slot, value in self.optimizer.state.get(b.master, {}).items():
                pieces = b.views(all_gather(value.detach(), b.group)) if value.dim() else [value] * len(b.params)
                for p, piece in zip(b.params, pieces):
                    out.setdefault(names[id(p)], {})[slot] = piece.clone()
        return out

    def load_state_by_name(self, states: dict) -> None:
        """The inverse: take this rank's slice of each bucket's state."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        for b in self.buckets:
            for slot, value in states.get(names[id(b.params[0])], {}).items():
                if value.dim():  # a moment, flattened as the bucket is (else Adam's step count, one for all)
                    whole = [states[names[id(p)]][slot].to(b.master.device, b.master.dtype) for p in b.params]
                    value = b._flatten(whole)[b.slice]
                self.optimizer.state[b.master][slot] = value.clone()

    # -- what each rank holds, measured on the real tensors ----------------------------------------
    def param_bytes(self) -> int:
        """Full weights held now, plus what each bucket keeps (its master slice; ZeRO-3: its shard, and
        what its transport keeps)."""
        held = [*self.module.parameters(), *(t for b in self.buckets for t in b.held())]
        # By storage: a bucket's parameters share one buffer (ZeRO-3: of 0 bytes once freed), a shard may be its master.
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}.values())

    def gradient_bytes(self) -> int:
        """Full gradients not yet reduce-scattered, plus this rank's gradient slices."""
        full = sum(p.grad.nbytes for p in self.module.parameters() if p.grad is not None)
        return full + sum(b.grad_slice.nbytes for b in self.buckets if b.grad_slice is not None)
