"""Checkers of the exercises that communicate (chapters 1-3): 1.1 the ring all-reduce, 2.1 gradient
averaging with hooks, 2.2 a bucketed all-reduce, 3.1 a ZeRO-1 step. Each runs on 2-4 gloo ranks
(tests/harness.py's `run_ranks`); the per-rank functions live at module level (the workers import
them by name) and load the student's file from its path on each rank.
"""

from __future__ import annotations

import itertools

import torch
from check_common import NotImplementedYet, attempt, collect, guarded, load, max_diff, on_ranks, world_group

# ----------------------------------------------------------------------------------------------
# 1.1 Ring all-reduce from send/recv
# ----------------------------------------------------------------------------------------------

RING_LENGTHS = (12, 7)  # 12: every N of 2, 3, 4 divides it; 7: none does


def _rank_input(rank: int, length: int) -> torch.Tensor:
    return torch.arange(length, dtype=torch.float64) * (rank + 1) + 10.0 ** rank


def _ring_rank(rank, world, student):
    import torch.distributed as dist

    problems, sent = [], {}
    real_all_reduce = dist.all_reduce

    def refuse(*args, **kwargs):
        raise RuntimeError("torch.distributed.all_reduce is off in this exercise: build it from send/recv")

    dist.all_reduce = refuse
    try:
        for length in RING_LENGTHS:
            group = world_group("ring")
            expected = sum(_rank_input(r, length) for r in range(world))
            t = _rank_input(rank, length)
            out = attempt(student.ring_all_reduce, t, group)
            out = t if out is None else out
            if out.shape != expected.shape or not torch.allclose(out, expected, rtol=0, atol=1e-9):
                problems.append(f"rank {rank}: N={world}, length {length}: the result is not the sum over "
                                f"ranks: {max_diff(out, expected)}")
            sent[length] = group.ledger.get("ring", "send").bytes
    finally:
        dist.all_reduce = real_all_reduce
    return {"problems": problems, "sent": sent}


_ring_rank_guarded = guarded(_ring_rank)


def _ring_bytes_problems(world: int, results: list[dict]) -> list[str]:
    """What the ring sent, per rank, against 2(N-1)/N * S (exact when N divides the length)."""
    problems = []
    for length in RING_LENGTHS:
        S, chunk = length * 8, -(-length // world) * 8  # float64; the largest chunk
        sent = [r["sent"][length] for r in results]
        if length % world == 0:
            wrong = [(r, b) for r, b in enumerate(sent) if b != 2 * (world - 1) * S // world]
        else:
            wrong = [(r, b) for r, b in enumerate(sent) if not 0 < b <= 2 * (world - 1) * chunk]
        if sum(sent) < 2 * (world - 1) * S:
            wrong = wrong or [(0, sent[0])]
        for r, b in wrong:
            problems.append(f"rank {r}: N={world}, length {length} ({S} bytes): sent {b} bytes by the ledger, "
                            f"expected 2(N-1)/N * S = {2 * (world - 1) * S / world:.0f}"
                            + ("" if length % world == 0 else " (up to the uneven chunks)"))
    return problems


def check_ring(path, run_ranks) -> list[str]:
    problems = []
    for world in (2, 3, 4):
        results = run_ranks(world, _ring_rank_guarded, str(path))
        rank_problems = collect(results)
        problems += rank_problems
        if rank_problems:
            break
        problems += _ring_bytes_problems(world, results)
    student = load(path)
    try:
        for S, N in itertools.product((1200, 3000, 4_800_000), (2, 3, 4)):  # N divides S
            predicted = attempt(student.bytes_sent_per_rank, S, N)
            if abs(float(predicted) - 2 * (N - 1) * S / N) > 1e-6 * S:
                problems.append(f"bytes_sent_per_rank({S}, {N}) = {predicted}: not what the ring sends")
                break
    except NotImplementedYet as e:
        problems.append(str(e))
    return problems


# ----------------------------------------------------------------------------------------------
# 2.1 Data-parallel gradient averaging with hooks
# ----------------------------------------------------------------------------------------------

def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def _dp_rank(rank, world, student):
    torch.manual_seed(1)
    x, target = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    reference = _mlp()
    ((reference(x) - target) ** 2).mean().backward()
    model, group = _mlp(), world_group("dp")
    attempt(student.install_grad_averaging, model, group)
    rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
    ((model(x[rows]) - target[rows]) ** 2).mean().backward()
    problems = []
    if group.ledger.get("dp", "all_reduce").calls == 0:
        problems.append(f"rank {rank}: dp={world}: no all_reduce on the group during backward")
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None:
            problems.append(f"rank {rank}: dp={world}: {name}.grad is None after backward")
        elif not torch.allclose(p.grad, ref.grad, rtol=1e-10, atol=1e-12):
            summed = " (it is dp times the right one: summed, not averaged?)" if torch.allclose(
                p.grad, world * ref.grad, rtol=1e-10, atol=1e-12) else ""
            problems.append(f"rank {rank}: dp={world}: {name}.grad differs from the whole batch's gradient "
                            f"on one device: {max_diff(p.grad, ref.grad)}{summed}")
    return {"problems": problems}


_dp_rank_guarded = guarded(_dp_rank)


def check_dp_hooks(path, run_ranks) -> list[str]:
    return on_ranks(_dp_rank_guarded, path, run_ranks)


# ----------------------------------------------------------------------------------------------
# 2.2 A bucketed all-reduce
# ----------------------------------------------------------------------------------------------

BUCKET_BYTES = (600, 1, 10**9)  # the test model's gradients: 32, 512, 128, 1024 bytes in backward order


def expected_bucket_bytes(model, bucket_bytes: int) -> list[int]:
    """The library's buckets (data_parallel.bucket_params, parameters in backward order), in bytes."""
    from minipar.data_parallel import bucket_params
    params = list(reversed(list(model.parameters())))
    return [sum(p.numel() * p.element_size() for p in b) for b in bucket_params(params, bucket_bytes / 2**20)]


def _bucket_problems(where, model, reference, group, during: int, want: list[int]) -> list[str]:
    sizes = [n for (_, op, _, n) in group.ledger.trace if op == "all_reduce"]
    others = sorted({op for (_, op, _, _) in group.ledger.trace if op != "all_reduce"})
    if sorted(sizes) != sorted(want) or others:
        return [f"{where}: the ledger shows {len(sizes)} all-reduces of {sizes} bytes"
                + (f" and {others}" if others else "") + f", expected one per bucket: {want}"]
    if len(want) > 1 and during == 0:
        return [f"{where}: no all-reduce started during backward: launch each bucket once its gradients are ready"]
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None or not torch.allclose(p.grad, ref.grad, rtol=1e-10, atol=1e-12):
            got = "None" if p.grad is None else max_diff(p.grad, ref.grad)
            return [f"{where}: {name}.grad differs from the whole batch's gradient on one device: {got}"]
    return []


def _bucket_rank(rank, world, student):
    torch.manual_seed(1)
    x, target = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    reference = _mlp()
    ((reference(x) - target) ** 2).mean().backward()
    rows = slice(rank * 12 // world, (rank + 1) * 12 // world)
    for bucket_bytes in BUCKET_BYTES:
        model, group = _mlp(), world_group("dp")
        group.ledger.trace = []
        sync = attempt(student.BucketedGradSync, model, group, bucket_bytes)
        ((model(x[rows]) - target[rows]) ** 2).mean().backward()
        during = len(group.ledger.trace)
        attempt(sync.finish)
        problems = _bucket_problems(f"rank {rank}: dp={world}, bucket_bytes={bucket_bytes}", model, reference,
                                    group, during, expected_bucket_bytes(model, bucket_bytes))
        if problems:
            return {"problems": problems}
    return {"problems": []}


_bucket_rank_guarded = guarded(_bucket_rank)


def check_buckets(path, run_ranks) -> list[str]:
    return on_ranks(_bucket_rank_guarded, path, run_ranks)


# ----------------------------------------------------------------------------------------------
# 3.1 A ZeRO-1 step
# ----------------------------------------------------------------------------------------------

ZERO_P, ZERO_STEPS = 24, 3


def _zero1_grad(rank: int, step: int) -> torch.Tensor:
    return torch.sin(torch.arange(ZERO_P, dtype=torch.float64) * (rank + 1) + step)  # [P]


def adam_by_hand(param, grad, state, step: int, lr: float, betas=(0.9, 0.999), eps=1e-8) -> None:
    """torch.optim.Adam's update (its defaults), in place, written out: the one-device reference
    (and no torch.optim in the checker, whose first step imports a lot)."""
    m, v = state.setdefault("m", torch.zeros_like(param)), state.setdefault("v", torch.zeros_like(param))
    m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))


def _zero1_rank(rank, world, student):
    torch.manual_seed(3)
    reference = torch.randn(ZERO_P, dtype=torch.float64)
    flat, state = reference.clone(), {}
    optimizer = attempt(student.Zero1Adam, flat, world_group("dp"), 0.1)
    for step in range(ZERO_STEPS):
        adam_by_hand(reference, sum(_zero1_grad(r, step) for r in range(world)) / world, state, step + 1, 0.1)
        attempt(optimizer.step, _zero1_grad(rank, step))
        if not torch.allclose(flat, reference, rtol=1e-10, atol=1e-12):
            by_slice = (flat - reference).abs().reshape(world, -1).amax(1)
            return {"problems": [f"rank {rank}: dp={world}: after step {step + 1} the parameters differ from Adam "
                                 f"on one device: {max_diff(flat, reference)}; by rank slice: "
                                 f"{[f'{d:.3g}' for d in by_slice.tolist()]}"]}
    held = attempt(optimizer.state_numel)
    if held != 2 * ZERO_P // world:
        return {"problems": [f"rank {rank}: dp={world}: holds {held} numbers of Adam state, "
                             f"expected 2 P / N = {2 * ZERO_P // world}"]}
    return {"problems": []}


_zero1_rank_guarded = guarded(_zero1_rank)


def check_zero1(path, run_ranks) -> list[str]:
    return on_ranks(_zero1_rank_guarded, path, run_ranks)


