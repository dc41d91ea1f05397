"""Checkers of the exercises that communicate (chapters 1-3): 1.1 the ring all-reduce, 2.1 gradient
averaging with hooks, 2.2 a bucketed all-reduce, 3.1 a ZeRO-1 step. Each runs on 2-4 gloo ranks
(tests/harness.py's `run_ranks`), also as two groups of two inside four ranks (an answer that uses
the world instead of its group fails there); the per-rank functions live at module level (the
workers import them by name) and load the student's file from its path on each rank.

Each grades the algorithm, not only the result: the ledger says which collectives ran on how many
bytes, and which peer each of a ring's sends went to; a wrapped torch.distributed.all_reduce says
whether a bucket's message was in flight while backward ran (on a model whose gradients finish out
of definition order, with a tied weight); what a ZeRO-1 optimizer allocated and still holds says
where its Adam state lives; and the library's own answer (and its siblings) is switched off while
the student's code runs.
"""

from __future__ import annotations

import gc
import itertools
import time
import weakref

import torch
from check_common import (
    NotImplementedYet,
    attempt,
    collect,
    guarded,
    load,
    max_diff,
    on_ranks,
    storage_numel,
    where,
    world_group,
)

from minipar.data_parallel import bucket_params  # the checker's own: the exercise switches it off

# ----------------------------------------------------------------------------------------------
# 1.1 Ring all-reduce from send/recv
# ----------------------------------------------------------------------------------------------

RING_LENGTHS = (12, 7)  # 12: every N of 2, 3, 4 divides it; 7: none does


def _rank_input(rank: int, length: int) -> torch.Tensor:
    return torch.arange(length, dtype=torch.float64) * (rank + 1) + 10.0 ** rank


# The library's ring, and every collective that would do the exercise's work in one call
RING_OFF = ("minipar.collectives:ring_all_reduce", "minipar.collectives:all_reduce", "minipar.collectives:all_gather",
            "minipar.collectives:all_gather_into", "minipar.collectives:reduce_scatter",
            "torch.distributed:all_reduce", "torch.distributed:reduce_scatter", "torch.distributed:all_gather",
            "torch.distributed:reduce_scatter_tensor", "torch.distributed:all_gather_into_tensor")


def _ring_rank(rank, world, student):
    problems, sent = [], {}
    for length in RING_LENGTHS:
        group = world_group("ring")
        expected = sum(_rank_input(r, length) for r in range(world))
        t = _rank_input(rank, length)
        group.ledger.trace = []  # each message with its peer
        out = attempt(student.ring_all_reduce, t, group)
        out = t if out is None else out
        if out.shape != expected.shape or not torch.allclose(out, expected, rtol=0, atol=1e-9):
            problems.append(f"rank {rank}: N={world}, length {length}: the result is not the sum over "
                            f"ranks: {max_diff(out, expected)}")
        others = sorted({op for (_, op) in group.ledger.entries} - {"send", "recv"})
        if others:
            problems.append(f"rank {rank}: N={world}: the ledger shows {others} on the group: a ring is built "
                            f"from send and recv alone")
        peers = sorted({peer for (_, op, peer, _) in group.ledger.trace if op == "send"})
        if len(peers) > 1:
            problems.append(f"rank {rank}: N={world}, length {length}: sent to ranks {peers}: not a ring, which "
                            f"sends only to its next rank; each chunk travels N-1 hops, summed on the way, not "
                            f"straight to the rank that reduces it")
        sent[length] = (group.ledger.get("ring", "send").bytes, group.ledger.get("ring", "send").calls)
        if problems:  # a wrong ring may send chunks of sizes the peer does not expect: stop before it does
            break
    return {"problems": problems, "sent": sent}


_ring_rank_guarded = guarded(_ring_rank, RING_OFF, "build the all-reduce from send and recv")


def _ring_bytes_problems(world: int, results: list[dict]) -> list[str]:
    """What the ring sent, per rank, against 2(N-1)/N * S (exact when N divides the length), in
    2(N-1) messages of one chunk each."""
    problems = []
    for length in RING_LENGTHS:
        S, chunk = length * 8, -(-length // world) * 8  # float64; the largest chunk
        sent = [r["sent"][length][0] for r in results]
        if length % world == 0:
            wrong = [(r, b) for r, b in enumerate(sent) if b != 2 * (world - 1) * S // world]
        else:
            wrong = [(r, b) for r, b in enumerate(sent) if not 0 < b <= 2 * (world - 1) * chunk]
        if sum(sent) < 2 * (world - 1) * S:
            wrong = wrong or [(0, sent[0])]
        for r, b in wrong:
            problems.append(f"rank {r}: N={world}, length {length} ({S} bytes): sent {b} bytes by the ledger, "
                            f"expected 2(N-1)/N * S = {2 * (world - 1) * S / world:.0f}"
                            + ("" if length % world == 0 else " (up to the uneven chunks)")
                            + (" (send through minipar.collectives, so that the ledger sees it)" if b == 0 else ""))
        calls = [r["sent"][length][1] for r in results]
        if not problems and any(c != 2 * (world - 1) for c in calls):
            problems.append(f"N={world}, length {length}: the ranks sent {calls} messages, expected 2(N-1) = "
                            f"{2 * (world - 1)} each: one chunk per step, N-1 steps of reduce-scatter, N-1 of "
                            f"all-gather")
    return problems


def check_ring(path, run_ranks) -> list[str]:
    problems = []
    for world in (2, 3, 4):
        results = run_ranks(world, _ring_rank_guarded, str(path))
        rank_problems = collect(results)
        problems += rank_problems or _ring_bytes_problems(world, results)
        if problems:
            break
    student = load(path)
    try:
        for S, N in itertools.product((1200, 3000, 4_800_000), (2, 3, 4, 5)):  # N divides S
            predicted = attempt(student.bytes_sent_per_rank, S, N)
            if abs(float(predicted) - 2 * (N - 1) * S / N) > 1e-6 * S:
                problems.append(f"bytes_sent_per_rank({S}, {N}) = {predicted}: not what the ring sends")
                break
    except NotImplementedYet as e:
        problems.append(str(e))
    return problems


# ----------------------------------------------------------------------------------------------
# Chapter 2's model and batch
# ----------------------------------------------------------------------------------------------

def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def _batch(group) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """The group's whole batch (12 rows; each group its own) and this rank's rows of it."""
    torch.manual_seed(1 + group.ranks[0])
    x, target = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    return x, target, slice(group.rank * 12 // group.size, (group.rank + 1) * 12 // group.size)


def _reference_grads(x, target) -> torch.nn.Module:
    reference = _mlp()
    ((reference(x) - target) ** 2).mean().backward()
    return reference


def _grad_problems(at: str, model, reference, group) -> list[str]:
    import torch.distributed as dist
    world = dist.get_world_size()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            return [f"{at}: {name}.grad is None after backward"]
        if not torch.allclose(p.grad, ref.grad, rtol=1e-10, atol=1e-12):
            hint = next((f" (it is {k:g} times the right one: {why})" for k, why in
                         ((group.size, "summed, not averaged?"),
                          (group.size / world, "divided by the world's size, not the group's?"))
                         if k != 1 and torch.allclose(p.grad, k * ref.grad, rtol=1e-10, atol=1e-12)), "")
            return [f"{at}: {name}.grad differs from the whole batch's gradient on one device: "
                    f"{max_diff(p.grad, ref.grad)}{hint}"]
    return []


# ----------------------------------------------------------------------------------------------
# 2.1 Data-parallel gradient averaging with hooks
# ----------------------------------------------------------------------------------------------

# The library's DataParallel, and its siblings that average gradients too (ZeRO's wrappers)
DP_OFF = ("minipar.data_parallel:DataParallel", "minipar.data_parallel:GradSync", "minipar.data_parallel:GradBucket",
          "minipar.zero:ZeroDataParallel", "minipar.zero:ZeroBucket", "minipar.zero3:Zero3DataParallel",
          "minipar.zero3:ShardedBucket")


def _dp_rank(rank, world, student, group_size):
    group = world_group("dp", group_size)
    x, target, rows = _batch(group)
    reference = _reference_grads(x, target)
    model, at = _mlp(), where(rank, world, group, "dp")
    attempt(student.install_grad_averaging, model, group)
    ((model(x[rows]) - target[rows]) ** 2).mean().backward()
    entry, grad_bytes = group.ledger.get("dp", "all_reduce"), sum(p.numel() * 8 for p in model.parameters())
    others = sorted({op for (_, op) in group.ledger.entries} - {"all_reduce"})
    if entry.calls == 0:
        return {"problems": [f"{at}: the ledger shows no all_reduce on the group during backward (use "
                             f"minipar.collectives.all_reduce(p.grad, group) in the hook)"]}
    if entry.bytes != grad_bytes or others:
        return {"problems": [f"{at}: the ledger shows {entry.calls} all-reduces of {entry.bytes} bytes in all"
                             + (f" and {others}" if others else "") + f": expected each gradient all-reduced once, "
                             f"{grad_bytes} bytes over {len(list(model.parameters()))} parameters"]}
    return {"problems": _grad_problems(at, model, reference, group)}


_dp_rank_guarded = guarded(_dp_rank, DP_OFF)


def check_dp_hooks(path, run_ranks) -> list[str]:
    return on_ranks(_dp_rank_guarded, path, run_ranks)


# ----------------------------------------------------------------------------------------------
# 2.2 A bucketed all-reduce
# ----------------------------------------------------------------------------------------------

class _Tangled(torch.nn.Module):
    """2.2's model. Its gradients finish out of definition order (`out`, defined first, is used last,
    so backward finishes it first), and `gate` is tied: it scales the input and shifts the output, so
    its gradient is ready last, once both uses have sent theirs. Buckets are built from the parameters
    in reverse definition order (as the exercise says, and bucket_params does): tied.gate, hidden.bias,
    hidden.weight, out.bias, out.weight; backward finishes out.bias and out.weight first, tied.gate last.
    A bucket launched when its "last" parameter's hook fires, without counting which of its gradients
    are ready, sends a gradient backward has not finished."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.out = torch.nn.Linear(16, 4)  # defined first, used last
        self.hidden = torch.nn.Linear(8, 16)
        self.tied = torch.nn.ParameterDict({"gate": torch.linspace(0.5, 1.5, 8)})  # used at both ends
        self.double()

    def forward(self, x):
        gate = self.tied["gate"]
        return self.out(torch.tanh(self.hidden(x * gate))) + gate[:4]  # [b, 4]


def _tangled_reference(x, target) -> torch.nn.Module:
    reference = _Tangled()
    ((reference(x) - target) ** 2).mean().backward()
    return reference


# The test model's buckets (reverse definition order): 64, 128, 1024, 32, 512 bytes. 192 = 64 + 128: a
# bucket closes at exactly its size (at least bucket_bytes, as bucket_params does).
BUCKET_BYTES = (600, 192, 1, 10**9)
BUCKET_OFF = DP_OFF + ("minipar.data_parallel:bucket_params", "minipar.zero:bucket_plan")  # ZeRO's buckets too


def expected_bucket_bytes(model, bucket_bytes: int) -> list[int]:
    """The library's buckets (data_parallel.bucket_params, parameters in reverse definition order), in bytes."""
    params = list(reversed(list(model.parameters())))
    return [sum(p.numel() * p.element_size() for p in b) for b in bucket_params(params, bucket_bytes / 2**20)]


class _Watch:
    """The order of events in one step, from the checker's side: each gradient becoming ready (a
    post-accumulate hook registered before the student's), each torch.distributed.all_reduce posted
    (blocking or not), each wait on its handle, and the end of backward."""

    def __init__(self, model):
        import torch.distributed as dist
        self.events, self.dist, self.real = [], dist, dist.all_reduce
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: self.events.append(("ready", name)))

    def __enter__(self):
        def all_reduce(t, *args, async_op=False, **kwargs):
            i = sum(e[0] == "post" for e in self.events)
            self.events.append(("post", i, t.numel() * t.element_size(), async_op))
            work = self.real(t, *args, async_op=async_op, **kwargs)
            return _WatchedWork(work, i, self.events) if async_op else work
        self.dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self.real

    def drawn(self) -> str:
        """The events, briefly: ready 2.bias, ..., all_reduce#0 672B async, ..., END OF BACKWARD, wait#0."""
        words = {"ready": lambda e: f"ready {e[1]}", "end": lambda e: "END OF BACKWARD",
                 "wait": lambda e: f"wait#{e[1]}",
                 "post": lambda e: f"all_reduce#{e[1]} {e[2]}B {'async' if e[3] else 'BLOCKING'}"}
        return ", ".join(words[e[0]](e) for e in self.events)


class _WatchedWork:
    def __init__(self, work, index, events):
        self.work, self.index, self.events = work, index, events

    def wait(self, *args, **kwargs):
        self.events.append(("wait", self.index))
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def _overlap_problems(at: str, watch: _Watch, buckets: int) -> list[str]:
    """Every bucket's all-reduce asynchronous, the first started before backward's last gradient, none
    waited for before backward's last gradient was ready (a wait in a callback queued on autograd's
    engine, which runs once every gradient is ready, is fine: DDP waits there), each waited for."""
    events = watch.events
    posts = [e for e in events if e[0] == "post"]
    end = events.index(("end",))
    blocking = [e[1] for e in posts if not e[3]]
    if blocking:
        return [f"{at}: all_reduce #{blocking[0]} was blocking (async_op=False): backward stood still until it "
                f"arrived, nothing overlapped; start it with async_op=True, keep the handle, wait in finish(). "
                f"Events: {watch.drawn()}"]
    last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
    if buckets > 1 and not any(events.index(e) < last_ready for e in posts):
        return [f"{at}: no all-reduce started before backward's last gradient was ready: launch each bucket "
                f"from the hooks, as soon as its gradients are ready. Events: {watch.drawn()}"]
    early = [e[1] for i, e in enumerate(events) if e[0] == "wait" and i < min(end, last_ready)]
    if early:
        return [f"{at}: the handle of all_reduce #{early[0]} was waited for during backward: it was not in flight "
                f"while backward ran; wait in finish(). Events: {watch.drawn()}"]
    waited = {e[1] for e in events if e[0] == "wait"}
    unwaited = [e[1] for e in posts if e[1] not in waited]
    if unwaited:
        return [f"{at}: nobody waited for the handle of all_reduce #{unwaited[0]}: its result may not have "
                f"arrived when it is read. Events: {watch.drawn()}"]
    return []


def _bucket_problems(at, model, reference, group, want: list[int]) -> list[str]:
    sizes = [n for (_, op, _, n) in group.ledger.trace if op == "all_reduce"]
    others = sorted({op for (_, op, _, _) in group.ledger.trace if op != "all_reduce"})
    if sorted(sizes) != sorted(want) or others:
        return [f"{at}: the ledger shows {len(sizes)} all-reduces of {sizes} bytes"
                + (f" and {others}" if others else "") + f", expected one per bucket: {want}"
                + (" (send through minipar.collectives, so that the ledger sees it)" if not sizes else "")]
    return _grad_problems(at, model, reference, group)


def _bucket_rank(rank, world, student, group_size):
    group = world_group("dp", group_size)
    x, target, rows = _batch(group)
    reference = _tangled_reference(x, target)
    for bucket_bytes in BUCKET_BYTES:
        model, at = _Tangled(), f"{where(rank, world, group, 'dp')}, bucket_bytes={bucket_bytes}"
        want = expected_bucket_bytes(model, bucket_bytes)
        group.ledger.trace = []
        watch = _Watch(model)
        with watch:
            sync = attempt(student.BucketedGradSync, model, group, bucket_bytes)
            ((model(x[rows]) - target[rows]) ** 2).mean().backward()
            watch.events.append(("end",))
            attempt(sync.finish)
        problems = _bucket_problems(at, model, reference, group, want) or _overlap_problems(at, watch, len(want))
        if problems:
            return {"problems": problems}
    return {"problems": []}


_bucket_rank_guarded = guarded(_bucket_rank, BUCKET_OFF)


def check_buckets(path, run_ranks) -> list[str]:
    return on_ranks(_bucket_rank_guarded, path, run_ranks)


# ----------------------------------------------------------------------------------------------
# 3.1 A ZeRO-1 step
# ----------------------------------------------------------------------------------------------

ZERO_P, ZERO_STEPS = 24, 3
ZERO_OFF = ("minipar.zero:ZeroDataParallel", "minipar.zero:ZeroBucket", "minipar.zero3:Zero3DataParallel",
            "minipar.zero3:ShardedBucket")  # ZeRO-3's classes are ZeRO-1's, subclassed


def _zero1_grad(group, rank: int, step: int) -> torch.Tensor:
    """Group rank `rank`'s gradient at `step` (each group its own)."""
    return torch.sin(torch.arange(ZERO_P, dtype=torch.float64) * (rank + 1) + step + group.ranks[0])  # [P]


def adam_by_hand(param, grad, state, step: int, lr: float, betas=(0.9, 0.999), eps=1e-8) -> None:
    """torch.optim.Adam's update (its defaults), in place, written out: the one-device reference
    (and no torch.optim in the checker, whose first step imports a lot)."""
    m, v = state.setdefault("m", torch.zeros_like(param)), state.setdefault("v", torch.zeros_like(param))
    m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))


def _zero1_traffic_problems(at: str, group) -> list[str]:
    """Per step one reduce-scatter of the P-vector and one all-gather of it: 2(N-1)/N * P sent, no all-reduce."""
    n, S = group.size, ZERO_P * 8
    seen = {op: e for (_, op), e in group.ledger.entries.items()}
    want = {"reduce_scatter": (ZERO_STEPS, ZERO_STEPS * S), "all_gather": (ZERO_STEPS, ZERO_STEPS * S)}
    if {op: (e.calls, e.bytes) for op, e in seen.items()} == want:
        return []
    sent = sum(e.sent for e in seen.values())
    shown = ", ".join(f"{op} x{e.calls} ({e.bytes} bytes)" for op, e in sorted(seen.items())) or "nothing"
    return [f"{at}: over {ZERO_STEPS} steps the ledger shows {shown}, {sent // ZERO_STEPS} bytes sent per step; "
            f"expected per step one reduce_scatter and one all_gather of the P-vector ({S} bytes each): "
            f"2(N-1)/N * P = {2 * (n - 1) * S // n} bytes sent"
            + (" (an all-reduce alone sends 2(N-1)/N * P: it gives every rank every slice's sum, of which "
               "ZeRO-1 needs only its own)" if "all_reduce" in seen else "")]


class _Allocations:
    """Every tensor made while it is active (each op's outputs, through torch's dispatcher: factories,
    arithmetic, views, collectives' outputs), kept by weak reference. `alive(skip)`: those still alive
    afterwards, one per storage, the storages of `skip` and scalars left out. What an optimizer holds,
    measured so, is found wherever it hides it (an attribute, a closure, a functools.partial, a global)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        made = self.made = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                made.extend(weakref.ref(t) for t in torch.utils._pytree.tree_leaves(out)
                            if isinstance(t, torch.Tensor))
                return out
        self.mode = Record

    def run(self, fn, *args):
        with self.mode():
            return fn(*args)

    def alive(self, skip: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        # A message's buffer is let go by gloo's worker thread a moment after the wait() on it returned: give
        # that thread time to drop it, so that a finished message's buffer is not counted as held.
        time.sleep(0.2)
        gc.collect()
        skipped = {t.untyped_storage().data_ptr() for t in skip}
        found = {}
        for ref in self.made:
            t = ref()
            if t is not None and storage_numel(t) > 1 and t.untyped_storage().data_ptr() not in skipped:
                found.setdefault(t.untyped_storage().data_ptr(), t)
        return list(found.values())


def _zero1_state_problems(at: str, optimizer, held: list[torch.Tensor], n: int) -> list[str]:
    """What the optimizer allocated and still holds besides flat_param and the gradients it was handed:
    this rank's slice, Adam's m and v for it (3 P/N numbers; a P/N gradient slice more is fine),
    nothing of P numbers."""
    numbers = sum(storage_numel(t) for t in held)
    whole = [t for t in held if storage_numel(t) >= ZERO_P]
    claimed = attempt(optimizer.state_numel)
    if whole or numbers > 4 * ZERO_P // n:
        return [f"{at}: the optimizer holds {len(held)} tensors of {numbers} numbers besides flat_param (allocated "
                f"in its construction and steps, still alive after them)"
                + (f", {len(whole)} of them of all P = {ZERO_P} (Adam's m and v over the whole vector?)" if whole
                   else "") + f" (state_numel() says {claimed}): ZeRO-1 keeps this rank's slice and its m and v, "
                f"3 P/N = {3 * ZERO_P // n}"]
    if claimed != 2 * ZERO_P // n:
        return [f"{at}: state_numel() = {claimed}, expected 2 P / N = {2 * ZERO_P // n} (m and v of the slice)"]
    return []


def _zero1_rank(rank, world, student, group_size):
    group = world_group("dp", group_size)
    n, at = group.size, where(rank, world, group, "dp")
    torch.manual_seed(3)
    reference = torch.randn(ZERO_P, dtype=torch.float64)
    flat, state, grads, allocations = reference.clone(), {}, [], _Allocations()
    optimizer = allocations.run(attempt, student.Zero1Adam, flat, group, 0.1)
    for step in range(ZERO_STEPS):
        adam_by_hand(reference, sum(_zero1_grad(group, r, step) for r in range(n)) / n, state, step + 1, 0.1)
        grads.append(_zero1_grad(group, group.rank, step))
        allocations.run(attempt, optimizer.step, grads[-1])
        if not torch.allclose(flat, reference, rtol=1e-10, atol=1e-12):
            by_slice = (flat - reference).abs().reshape(n, -1).amax(1)
            return {"problems": [f"{at}: after step {step + 1} the parameters differ from Adam on one device: "
                                 f"{max_diff(flat, reference)}; by rank slice: "
                                 f"{[f'{d:.3g}' for d in by_slice.tolist()]}"]}
    held = allocations.alive((flat, *grads))
    return {"problems": _zero1_traffic_problems(at, group) + _zero1_state_problems(at, optimizer, held, n)}


_zero1_rank_guarded = guarded(_zero1_rank, ZERO_OFF)


def check_zero1(path, run_ranks) -> list[str]:
    return on_ranks(_zero1_rank_guarded, path, run_ranks)
