"""The checkers of the exercises in docs/exercises/: each runs a student's file against the
single-device computation and returns what differs, as lines a student can act on.

    problems = check(1, "docs/exercises/ex1_ring_all_reduce.py")   # [] when it passes

A checker that needs ranks runs on gloo through tests/harness.py's `run_ranks`; its per-rank
functions live at module level here (the workers import them by name) and load the student's file
from its path on each rank. They never raise for a wrong answer: they return the problems, so a
pool of ranks survives a failed check. A skeleton's NotImplementedError becomes one line,
"not implemented yet", with its hint.
"""

from __future__ import annotations

import importlib.util
import itertools
from fractions import Fraction
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
EXERCISES_DIR = ROOT / "docs" / "exercises"


class NotImplementedYet(Exception):
    pass


def load(path) -> object:
    """The student's file as a fresh module (re-read on every call: the student edits it)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attempt(fn, *args):
    """Call the student's fn; a NotImplementedError becomes NotImplementedYet with its hint."""
    try:
        return fn(*args)
    except NotImplementedError as e:
        raise NotImplementedYet(f"{fn.__name__}: not implemented yet ({e})") from None


def max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)}, expected {tuple(b.shape)}"
    return f"max abs diff {(a.double() - b.double()).abs().max().item():.3g}"


def _guarded(rank_fn):
    """Run one rank's check; report a skeleton or a crash as a line, not a traceback."""
    def run(rank, world, path, *args):
        try:
            return rank_fn(rank, world, load(path), *args)
        except NotImplementedYet as e:
            return {"problems": [str(e)]}
        except Exception as e:  # noqa: BLE001 - the student's error, reported on one line
            return {"problems": [f"rank {rank}: raised {type(e).__name__}: {e}"]}
    run.__name__ = run.__qualname__ = rank_fn.__name__ + "_guarded"
    return run


def _collect(results: list[dict]) -> list[str]:
    """Every rank's problems, each line once (a skeleton fails the same way on every rank)."""
    return list(dict.fromkeys(p for r in results for p in r["problems"]))


def _world_group(name: str):
    import torch.distributed as dist

    from minipar.collectives import Group, Ledger
    return Group(name, dist.group.WORLD, list(range(dist.get_world_size())), Ledger())


# ----------------------------------------------------------------------------------------------
# 1. Ring all-reduce from send/recv
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
            group = _world_group("ring")
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


_ring_rank_guarded = _guarded(_ring_rank)


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
        rank_problems = _collect(results)
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
# 2. Data-parallel gradient averaging with hooks
# ----------------------------------------------------------------------------------------------

def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def _dp_rank(rank, world, student):
    torch.manual_seed(1)
    x, target = torch.randn(12, 8, dtype=torch.float64), torch.randn(12, 4, dtype=torch.float64)
    reference = _mlp()
    ((reference(x) - target) ** 2).mean().backward()
    model, group = _mlp(), _world_group("dp")
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


_dp_rank_guarded = _guarded(_dp_rank)


def check_dp_hooks(path, run_ranks) -> list[str]:
    for world in (2, 4):
        problems = _collect(run_ranks(world, _dp_rank_guarded, str(path)))
        if problems:
            return problems
    return []


# ----------------------------------------------------------------------------------------------
# 3. Column-parallel then row-parallel linear
# ----------------------------------------------------------------------------------------------

def _tp_rank(rank, world, student):
    torch.manual_seed(2)
    b, d, h = 5, 6, 8
    x, W1, W2 = (torch.randn(*s, dtype=torch.float64) for s in ((b, d), (h, d), (d, h)))
    dy = torch.randn(b, d, dtype=torch.float64)
    xr, W1r, W2r = (t.clone().requires_grad_() for t in (x, W1, W2))
    y_ref = torch.tanh(xr @ W1r.T) @ W2r.T
    y_ref.backward(dy)
    cols = slice(rank * h // world, (rank + 1) * h // world)
    xs = x.clone().requires_grad_()
    w1 = W1[cols].clone().requires_grad_()
    w2 = W2[:, cols].clone().requires_grad_()
    y = attempt(student.column_row_mlp, xs, w1, w2, _world_group("tp"))
    problems = []
    if y.shape != y_ref.shape or not torch.allclose(y, y_ref, rtol=1e-10, atol=1e-12):
        problems.append(f"rank {rank}: tp={world}: the output y differs from one device's: {max_diff(y, y_ref)}")
        return {"problems": problems}
    y.backward(dy)
    for name, got, want in (("x.grad", xs.grad, xr.grad), ("w1.grad", w1.grad, W1r.grad[cols]),
                            ("w2.grad", w2.grad, W2r.grad[:, cols])):
        if got is None:
            problems.append(f"rank {rank}: tp={world}: {name} is None after backward")
        elif not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            problems.append(f"rank {rank}: tp={world}: {name} differs from one device's: {max_diff(got, want)}")
    return {"problems": problems}


_tp_rank_guarded = _guarded(_tp_rank)


def check_column_row(path, run_ranks) -> list[str]:
    for world in (2, 4):
        problems = _collect(run_ranks(world, _tp_rank_guarded, str(path)))
        if problems:
            return problems
    return []


# ----------------------------------------------------------------------------------------------
# 4. GPipe's action list (one process: a schedule is data)
# ----------------------------------------------------------------------------------------------

def _gpipe_problems(actions, p: int, m: int) -> list[str]:
    from minipar.pipeline.schedules import Action, Schedule, ScheduleError, build, looped_placement
    from minipar.pipeline.timeline import simulate

    if not isinstance(actions, list) or len(actions) != p:
        return [f"p={p}, m={m}: expected a list of {p} lists (one per rank), got {type(actions).__name__} "
                f"of length {len(actions) if hasattr(actions, '__len__') else '?'}"]
    for s, acts in enumerate(actions):
        want = {Action(k, i, s) for k in "FB" for i in range(m)}
        if sorted(map(str, acts)) != sorted(map(str, want)) or set(acts) != want:
            return [f"rank {s}: p={p}, m={m}: expected each of F0..F{m - 1} and B0..B{m - 1} of stage {s} once, "
                    f"got {[f'{a.kind}{a.microbatch}@stage{a.stage}' for a in acts]}"]
        kinds = "".join(a.kind for a in acts)
        if kinds != "F" * m + "B" * m:
            return [f"rank {s}: p={p}, m={m}: GPipe runs every forward before any backward, got {kinds}"]
        for kind in "FB":
            order = [a.microbatch for a in acts if a.kind == kind]
            if order != sorted(order):
                return [f"rank {s}: p={p}, m={m}: the {kind}s are not in micro-batch order: {order}"]
    try:
        got = simulate(Schedule(actions, looped_placement(p)))
    except ScheduleError as e:
        return [f"p={p}, m={m}: the schedule cannot run: {e}"]
    want = simulate(build("gpipe", p, m))
    if abs(got.idle_fraction() - want.idle_fraction()) > 1e-12:
        return [f"p={p}, m={m}: bubble {got.idle_fraction():.3f}, GPipe's is {want.idle_fraction():.3f}"]
    return []


def check_gpipe(path, run_ranks=None) -> list[str]:
    student = load(path)
    try:
        for p, m in ((1, 3), (2, 1), (4, 8), (3, 5)):
            problems = _gpipe_problems(attempt(student.gpipe, p, m), p, m)
            if problems:
                return problems
    except NotImplementedYet as e:
        return [str(e)]
    return []


# ----------------------------------------------------------------------------------------------
# 5. Zigzag chunks for context parallelism
# ----------------------------------------------------------------------------------------------

def check_zigzag(path, run_ranks=None) -> list[str]:
    from minipar.context_parallel import zigzag_positions

    student = load(path)
    try:
        for cp, seq_len in ((1, 6), (2, 8), (3, 12), (4, 32)):
            got = [torch.as_tensor(attempt(student.zigzag_positions, r, cp, seq_len)) for r in range(cp)]
            held = torch.cat(got).sort().values
            if not torch.equal(held, torch.arange(seq_len)):
                return [f"cp={cp}, seq_len={seq_len}: the ranks do not hold every position exactly once: "
                        f"{[g.tolist() for g in got]}"]
            work = [int((g + 1).sum()) for g in got]
            if len(set(work)) > 1:
                return [f"cp={cp}, seq_len={seq_len}: unequal causal work per rank {work}: {[g.tolist() for g in got]}"]
            for r in range(cp):
                want = zigzag_positions(r, cp, seq_len)
                if not torch.equal(got[r], want):
                    return [f"rank {r}: cp={cp}, seq_len={seq_len}: positions {got[r].tolist()}, "
                            f"expected {want.tolist()} (chunk {r}, then chunk {2 * cp - 1 - r})"]
    except NotImplementedYet as e:
        return [str(e)]
    return []


# ----------------------------------------------------------------------------------------------
# 6, 7. Predict: the answer key is the run
# ----------------------------------------------------------------------------------------------

def _answer(path):
    answer = load(path).ANSWER
    if answer is None:
        raise NotImplementedYet("ANSWER: not answered yet (write your prediction in the file)")
    return answer


def check_predict_bubble(path, run_ranks=None) -> list[str]:
    from minipar.pipeline.schedules import build
    from minipar.pipeline.timeline import simulate
    try:
        answer = _answer(path)
    except NotImplementedYet as e:
        return [str(e)]
    answer = float(Fraction(answer) if isinstance(answer, str) else answer)
    run = simulate(build("gpipe", 4, 8)).idle_fraction()
    if abs(answer - run) > 0.005:
        return [f"ANSWER = {answer:.4f}: the simulated GPipe timeline (p=4, m=8, F=1, B=2) is idle "
                f"{'more' if run > answer else 'less'} than that (run scripts/step_06_pipeline.py, then think again)"]
    return []


def check_predict_activations(path, run_ranks=None) -> list[str]:
    from minipar.pipeline.schedules import build, peak_activations
    try:
        answer = tuple(_answer(path))
    except NotImplementedYet as e:
        return [str(e)]
    if len(answer) != 2:
        return [f"ANSWER = {answer}: write two numbers, (under GPipe, under 1F1B)"]
    run = tuple(peak_activations(build(name, 4, 8).actions[0]) for name in ("gpipe", "1f1b"))
    wrong = [f"under {name}, {a} is not it" for name, a, r in zip(("GPipe", "1F1B"), answer, run) if a != r]
    return [f"ANSWER = {answer}: " + "; ".join(wrong)] if wrong else []


# ----------------------------------------------------------------------------------------------
# 8. A ZeRO-1 step
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
    optimizer = attempt(student.Zero1Adam, flat, _world_group("dp"), 0.1)
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


_zero1_rank_guarded = _guarded(_zero1_rank)


def check_zero1(path, run_ranks) -> list[str]:
    for world in (2, 4):
        problems = _collect(run_ranks(world, _zero1_rank_guarded, str(path)))
        if problems:
            return problems
    return []


# number: (the student's file, what it is, its checker, roughly how long a student takes)
EXERCISES = {
    1: ("ex1_ring_all_reduce.py", "ring all-reduce from send/recv, and its bytes", check_ring, "45 min"),
    2: ("ex2_dp_hooks.py", "data-parallel gradient averaging with hooks", check_dp_hooks, "20 min"),
    3: ("ex3_zero1.py", "a ZeRO-1 step: Adam on this rank's slice", check_zero1, "30 min"),
    4: ("ex4_column_row.py", "column-parallel then row-parallel linear", check_column_row, "30 min"),
    5: ("ex5_zigzag.py", "zigzag chunks for context parallelism", check_zigzag, "10 min"),
    6: ("ex6_gpipe.py", "GPipe's action list", check_gpipe, "10 min"),
    7: ("ex7_predict_bubble.py", "predict: GPipe's bubble at p=4, m=8", check_predict_bubble, "10 min"),
    8: ("ex8_predict_activations.py", "predict: rank 0's activations, GPipe vs 1F1B", check_predict_activations,
        "10 min"),
}


def check(number: int, path=None, run_ranks=None) -> list[str]:
    """The problems of the student's file for exercise `number` ([] when it passes)."""
    name, _, checker, _ = EXERCISES[number]
    return checker(path or EXERCISES_DIR / name, run_ranks)
