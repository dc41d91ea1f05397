"""ZeRO stages 1 and 2 (chapter 3; Rajbhandari et al. 2020): shard the optimizer state, then the gradients.

    flat parameters, in buckets, each cut in N slices   [ r0 | r1 | r2 | r3 ][ r0 | r1 | r2 | r3 ] ...
    rank r owns slice r of each bucket: its optimizer state, its master weights, its gradients
    stage 1  after backward: reduce-scatter the gradients, update the slice, all-gather the weights
    stage 2  each bucket reduce-scattered *during* backward, once complete; full gradients freed

The same 2 (N-1)/N Psi bytes a step as data parallelism. Stage 3 is the subclass in zero3.py.
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
    """ZeRO's buckets, before any is made (the estimator plans them on paper too): (optimizer group
    index, grad_mean dimensions, params), never mixing groups, mesh cuts (tp, ep) nor reduction groups."""
    plan = []
    for i, pg in enumerate(param_groups):
        for cut in sorted({tuple(d for d, _ in placement_of(p).shards) for p in pg["params"]}):
            params = [p for p in pg["params"] if tuple(d for d, _ in placement_of(p).shards) == cut]
            for dims, same_group in by_grad_mean(list(reversed(params))).items():
                plan += [(i, dims, chunk) for chunk in chunks(same_group)]
    return plan


def model_state_bytes(psi: float, n: int, stage: int, weight: float = 2, grad: float = 2, k: float = 12) -> float:
    """The ZeRO paper's per-rank bytes of model states (mixed-precision Adam: 2 + 2 + 12 a parameter):
    stage 1 divides the optimizer state by n, stage 2 the gradients too, stage 3 all."""
    return psi * (weight / (n if stage >= 3 else 1) + grad / (n if stage >= 2 else 1) + k / (n if stage >= 1 else 1))


def packed(sizes: list[int], n: int) -> tuple[list[int], int]:
    """(where each parameter starts, the flat size): one after another, padded to a multiple of n."""
    return [sum(sizes[:i]) for i in range(len(sizes))], -(-sum(sizes) // n) * n


def kept_whole(sizes: list[int], n: int) -> tuple[list[int], int]:
    """As `packed`, but no parameter is cut: at most n runs of consecutive parameters, the largest run
    (S) as small as can be, run r at r x S. A slice is then whole parameters and padding (uneven)."""
    def runs(most: int) -> list[tuple[int, int]]:  # each parameter's (run, where in it), runs of at most `most`
        out, run, total = [], 0, 0
        for size in sizes:
            run, total = (run + 1, 0) if total + size > most else (run, total)
            out.append((run, total))
            total += size
        return out

    low, high = max(sizes), sum(sizes)
    while low < high:  # bisect for the smallest S that n runs can hold
        mid = (low + high) // 2
        low, high = (low, mid) if runs(mid)[-1][0] < n else (mid + 1, high)
    return [run * low + at for run, at in runs(low)], n * low


class ZeroBucket:
    """Some parameters as views into one flat vector (`full`, padded to a multiple of N; the all-gather
    writes into them), of which this rank owns 1/N: `master`, its slice in fp32 (float64 stays), and
    `grad_slice`. bf16-mixed: `full` becomes bf16. `whole`: slices end between parameters (Muon's)."""

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
        flat = self._flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        flat = flat.to(self.reduce or self.full.dtype)  # [padded]; --grad-reduce fp32: twice the bytes
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
        """Every rank's updated slice gathered straight into the parameters' flat vector, through `.data`
        (autograd does not count that as an in-place change of the parameters)."""
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
            self.buckets.append(self._new_bucket(chunk, groups.reduction(dims), groups.shards(placement_of(chunk[0])),
                                                 whole))
            masters[i].append(self.buckets[-1].master)
        self.optimizer = make_optimizer([{**{k: v for k, v in pg.items() if k != "params"}, "params": ms}
                                         for pg, ms in zip(param_groups, masters)])
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for p in (p for p in module.parameters() if p.requires_grad and stage >= 2):
            p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready))

    def _new_bucket(self, params, group: Group, spread: tuple[Group, ...], whole: bool = False) -> ZeroBucket:
        return ZeroBucket(params, group, spread, self.offload, self.precision, whole)

    def _chunks(self, params, bucket_mb):
        return bucket_params(params, bucket_mb)

    @contextmanager
    def no_sync(self):
        """Stage 1 accumulates full gradients locally anyway; stage 2 reduce-scatters every micro-batch."""
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
        """The norm from the slices (over dp, tp for tp's buckets, pp), clipping, the optimizer's step on
        the slices (bf16-mixed: fp32 copies), the weights' all-gather; `gate(slices)` first: False drops them."""
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
        """Every full weight present inside the block (bf16-mixed: the fp32 masters, what a checkpoint saves)."""
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
        """Full weights held now, plus what each bucket keeps (its master slice; ZeRO-3: its shard, ...)."""
        held = [*self.module.parameters(), *(t for b in self.buckets for t in b.held())]
        # By storage: a bucket's parameters share one buffer (ZeRO-3: of 0 bytes once freed), a shard may be its master.
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}.values())

    def gradient_bytes(self) -> int:
        """Full gradients not yet reduce-scattered, plus this rank's gradient slices."""
        full = sum(p.grad.nbytes for p in self.module.parameters() if p.grad is not None)
        return full + sum(b.grad_slice.nbytes for b in self.buckets if b.grad_slice is not None)
