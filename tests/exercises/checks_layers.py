"""Checkers of the exercises that build a piece of a model, a layer or a schedule: 0.1 counting
the activations, 4.1 the column/row pair and 7.1 top-k routing by all-to-all (on gloo ranks), 5.1
the zigzag, 6.1 GPipe's action list and 8.1 the model states per rank (in one process).

As in checks_collectives.py, the library's own answer is switched off while the student's code runs
(the checker keeps the originals it imported here), and the ones that communicate read the ledger:
4.1 one all-reduce forward and one backward, of [b, d] each; 7.1 the all-to-alls of the tokens and
of their results, of the sizes the routing gives.
"""

from __future__ import annotations

import itertools
import sys

import torch
from check_common import (
    ROOT,
    NotImplementedYet,
    attempt,
    guarded,
    load,
    max_diff,
    on_ranks,
    switched_off,
    where,
    world_group,
)

from minipar.context_parallel import zigzag_positions
from minipar.moe import MoE
from minipar.pipeline.schedules import gpipe
from minipar.planning.estimate import activation_bytes
from minipar.zero import model_state_bytes

# The library's own answers, off while the student's code runs: "module:attribute"
TP_OFF = ("minipar.tensor_parallel:ColumnParallelLinear", "minipar.tensor_parallel:ColumnParallelLinearInRegion",
          "minipar.tensor_parallel:RowParallelLinear",
          "minipar.tensor_parallel:ParallelMLP")
ZIGZAG_OFF = ("minipar.context_parallel:zigzag_positions", "minipar.context_parallel:split_sequence")
# gpipe, and every sibling schedule (sorting 1F1B's actions gives GPipe's); build() calls them: off too
GPIPE_OFF = tuple(f"minipar.pipeline.schedules:{name}" for name in ("gpipe", "naive", "one_f_one_b", "interleaved",
                                                                    "zero_bubble_h1", "zero_bubble_v"))
MOE_OFF = ("minipar.expert_parallel:expert_parallel_dispatch", "minipar.expert_parallel:parallelize_experts",
           "minipar.moe:MoE")
ACTIVATIONS_OFF = tuple(f"minipar.planning.estimate:{name}" for name in (
    "activation_bytes", "layer_activation_bytes", "head_activation_bytes", "moe_layer_activation_bytes")) + (
    "step_00_one_device:kept_for_backward",)  # chapter 0's script counts so too: imported, it is refused
if str(ROOT / "scripts" / "course") not in sys.path:  # where that script is imported from
    sys.path.append(str(ROOT / "scripts" / "course"))
STATES_OFF = ("minipar.zero:model_state_bytes", "minipar.precision:model_state_bytes")  # the sibling, by precision

# ----------------------------------------------------------------------------------------------
# 4.1 Column-parallel then row-parallel linear
# ----------------------------------------------------------------------------------------------

def _tp_traffic_problems(at: str, trace: list, nbytes: int, when: str, what: str) -> list[str]:
    seen = [(op, n) for (_, op, _, n) in trace]
    if seen == [("all_reduce", nbytes)]:
        return []
    return [f"{at}: {when} the ledger shows {seen or 'nothing'} on the group, expected one all_reduce of "
            f"{what} [b, d] = {nbytes} bytes"]


def _tp_rank(rank, world, student, group_size):
    group = world_group("tp", group_size)
    at, n, r = where(rank, world, group, "tp"), group.size, group.rank  # the layer is cut over the group
    torch.manual_seed(2 + group.ranks[0])
    b, d, h = 5, 6, 8
    x, W1, W2 = (torch.randn(*s, dtype=torch.float64) for s in ((b, d), (h, d), (d, h)))
    dy = torch.randn(b, d, dtype=torch.float64)
    xr, W1r, W2r = (t.clone().requires_grad_() for t in (x, W1, W2))
    y_ref = torch.tanh(xr @ W1r.T) @ W2r.T
    y_ref.backward(dy)
    cols = slice(r * h // n, (r + 1) * h // n)
    xs = x.clone().requires_grad_()
    w1 = W1[cols].clone().requires_grad_()
    w2 = W2[:, cols].clone().requires_grad_()
    group.ledger.trace = []
    y = attempt(student.column_row_mlp, xs, w1, w2, group)
    problems = []
    if y.shape != y_ref.shape or not torch.allclose(y, y_ref, rtol=1e-10, atol=1e-12):
        problems.append(f"{at}: the output y differs from one device's: {max_diff(y, y_ref)}")
        return {"problems": problems}
    forward = list(group.ledger.trace)
    problems += _tp_traffic_problems(at, forward, b * d * 8, "forward:", "the row-parallel layer's partial sums (g)")
    if problems:
        return {"problems": problems}
    y.backward(dy)
    for name, got, want in (("x.grad", xs.grad, xr.grad), ("w1.grad", w1.grad, W1r.grad[cols]),
                            ("w2.grad", w2.grad, W2r.grad[:, cols])):
        if got is None:
            problems.append(f"{at}: {name} is None after backward")
        elif not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            problems.append(f"{at}: {name} differs from one device's: {max_diff(got, want)}")
    return {"problems": problems or _tp_traffic_problems(at, group.ledger.trace[len(forward):], b * d * 8,
                                                         "backward:", "x's gradient (f's backward)")}


_tp_rank_guarded = guarded(_tp_rank, TP_OFF)


def check_column_row(path, run_ranks) -> list[str]:
    return on_ranks(_tp_rank_guarded, path, run_ranks)


# ----------------------------------------------------------------------------------------------
# 6.1 GPipe's action list (one process: a schedule is data)
# ----------------------------------------------------------------------------------------------

def _gpipe_problems(actions, p: int, m: int) -> list[str]:
    from minipar.pipeline.schedules import Action, Schedule, ScheduleError, looped_placement
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
    want = simulate(Schedule(gpipe(p, m), looped_placement(p)))  # the library's, imported before it was off
    if abs(got.idle_fraction() - want.idle_fraction()) > 1e-12:
        return [f"p={p}, m={m}: bubble {got.idle_fraction():.3f}, GPipe's is {want.idle_fraction():.3f}"]
    return []


def check_gpipe(path, run_ranks=None) -> list[str]:
    try:
        for p, m in ((1, 3), (2, 1), (4, 8), (3, 5)):
            with switched_off(GPIPE_OFF, student=path):
                actions = attempt(load(path).gpipe, p, m)
            problems = _gpipe_problems(actions, p, m)
            if problems:
                return problems
    except NotImplementedYet as e:
        return [str(e)]
    except RuntimeError as e:  # a switched-off function
        return [f"raised RuntimeError: {e}"]
    return []


# ----------------------------------------------------------------------------------------------
# 5.1 Zigzag chunks for context parallelism
# ----------------------------------------------------------------------------------------------

def check_zigzag(path, run_ranks=None) -> list[str]:
    try:
        for cp, seq_len in ((1, 6), (2, 8), (3, 12), (4, 32)):
            with switched_off(ZIGZAG_OFF, student=path):
                student = load(path)
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
    except RuntimeError as e:  # a switched-off function
        return [f"raised RuntimeError: {e}"]
    return []




# ----------------------------------------------------------------------------------------------
# 0.1 The bytes autograd keeps for backward
# ----------------------------------------------------------------------------------------------

def check_activation_bytes(path, run_ranks=None) -> list[str]:
    from minipar.model import Llama, get_config
    from minipar.run.config import TrainConfig

    for model, batch, seq_len in (("tiny", 2, 16), ("tiny", 1, 64)):
        c = get_config(model)
        cfg = TrainConfig(model=model, seq_len=seq_len, micro_batch=batch, global_batch=batch, dtype="float32")
        tokens = torch.randint(0, c.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
        want = activation_bytes(c, cfg)
        try:
            with switched_off(ACTIVATIONS_OFF, "count what autograd saves yourself, not with the estimator or "
                              "the chapter's script", student=path):
                got = attempt(load(path).saved_activation_bytes, Llama(c, seed=0), tokens)
        except NotImplementedYet as e:
            return [str(e)]
        except RuntimeError as e:
            return [f"raised RuntimeError: {e}"]
        # 1%: the estimator leaves out a few small tensors (0.1% of the tiny model's, here)
        if abs(got - want) > 0.01 * want:
            return [f"--model {model}, {batch} x {seq_len} tokens: {got:,} bytes, the estimator says {want:,} "
                    f"({'more' if want > got else 'fewer'}; within 1% passes)"]
    return []


# ----------------------------------------------------------------------------------------------
# 7.1 Top-k routing with all-to-all
# ----------------------------------------------------------------------------------------------

MOE_EXPERTS, MOE_TOP_K, MOE_DIM, MOE_FFN, MOE_TOKENS = 8, 2, 6, 5, 10  # tokens per rank


def _plain_moe():
    """minipar's single-device MoE layer (softmax router, dropless, no shared expert, no aux loss)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(n_experts=MOE_EXPERTS, top_k=MOE_TOP_K, router="softmax", capacity_factor=0.0,
                          aux_loss_coef=0.0, dim=MOE_DIM, expert_ffn_dim=MOE_FFN, n_shared_experts=0)
    torch.manual_seed(4)
    moe = MoE(cfg).double()  # the checker's MoE, imported before the exercise switched it off
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def _moe_traffic_problems(at: str, trace: list, rows_out: int, rows_in: int, when: str) -> list[str]:
    """The tokens' all-to-all (this rank's T*k assignments out) and the results' (the rows it received,
    back), in either order, and nothing else but the small all-to-all of the counts (forward)."""
    row = MOE_DIM * 8
    seen = [(op, n) for (_, op, _, n) in trace]
    rows = sorted(n for op, n in seen if op == "all_to_all" and n % row == 0 and n >= row)
    small = [(op, n) for op, n in seen if op != "all_to_all" or n not in rows]
    want = sorted((rows_out * row, rows_in * row))
    counts_ok = all(op == "all_to_all" and n <= MOE_EXPERTS * 8 for op, n in small) and (when == "forward" or
                                                                                          not small)
    if rows == want and counts_ok:
        return []
    return [f"{at}: {when}: the ledger shows {seen or 'nothing'} on the ep group, expected the all-to-all of this "
            f"rank's {rows_out} (token, expert) rows ({rows_out * row} bytes) and the one of the {rows_in} rows it "
            f"received ({rows_in * row} bytes)" + (", after the all-to-all of the counts" if when == "forward" else "")
            + (" (send through minipar.collectives' all_to_all or autograd_ops' all_to_all_with_grad, so the ledger "
               "sees it)" if not seen else "")]


def _moe_rank(rank, world, student, group_size):
    import torch.distributed as dist

    from minipar.moe import Experts
    group = world_group("ep", group_size)
    n_ranks, r = group.size, group.rank
    moe = _plain_moe()
    torch.manual_seed(5 + group.ranks[0])  # each group its own tokens
    x = torch.randn(n_ranks * MOE_TOKENS, MOE_DIM, dtype=torch.float64, requires_grad=True)  # [N*T, d]
    dy = torch.randn(n_ranks * MOE_TOKENS, MOE_DIM, dtype=torch.float64)
    moe(x).backward(dy)
    rows, n = slice(r * MOE_TOKENS, (r + 1) * MOE_TOKENS), MOE_EXPERTS // n_ranks
    with torch.no_grad():
        chosen = moe.router(x).softmax(-1).topk(MOE_TOP_K, dim=-1).indices  # [N*T, k]
    rows_in = int(((chosen >= r * n) & (chosen < (r + 1) * n)).sum())  # assignments to this rank's experts
    router = torch.nn.Linear(MOE_DIM, MOE_EXPERTS, bias=False).double()
    experts = Experts(n, MOE_DIM, MOE_FFN).double()
    with torch.no_grad():
        router.weight.copy_(moe.router.weight)
        for name, p in experts.named_parameters():
            p.copy_(getattr(moe.experts, name)[r * n : (r + 1) * n])
    xs = x.detach()[rows].clone().requires_grad_()
    at = f"{where(rank, world, group, 'ep')} ({n} experts each)"
    group.ledger.trace = []
    y = attempt(student.expert_parallel_moe, xs, router, experts, MOE_TOP_K, group)
    with torch.no_grad():
        y_ref = moe(x.detach())[rows]
    if y.shape != y_ref.shape or not torch.allclose(y, y_ref, rtol=1e-10, atol=1e-12):
        return {"problems": [f"{at}: the output differs from the plain MoE layer's on one device: "
                             f"{max_diff(y, y_ref)}"]}
    forward = list(group.ledger.trace)
    problems = _moe_traffic_problems(at, forward, MOE_TOKENS * MOE_TOP_K, rows_in, "forward")
    if problems:
        return {"problems": problems}
    y.backward(dy[rows])
    if router.weight.grad is not None:
        dist.all_reduce(router.weight.grad, group=group.pg)  # each rank's tokens give part of the router's gradient
    pairs = [("x.grad", xs.grad, x.grad[rows]), ("router.weight.grad (summed over ranks)", router.weight.grad,
                                                 moe.router.weight.grad)]
    pairs += [(f"experts.{k}.grad", p.grad, getattr(moe.experts, k).grad[r * n : (r + 1) * n])
              for k, p in experts.named_parameters()]
    for name, got, want in pairs:
        if got is None or not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            return {"problems": [f"{at}: {name} differs from one device's: "
                                 f"{'None' if got is None else max_diff(got, want)}"
                                 + (" (do the rows travel by all_to_all_with_grad, so that gradients travel "
                                    "back?)" if got is None else "")]}
    return {"problems": _moe_traffic_problems(at, group.ledger.trace[len(forward):], MOE_TOKENS * MOE_TOP_K,
                                              rows_in, "backward")}


_moe_rank_guarded = guarded(_moe_rank, MOE_OFF)


def check_moe_all_to_all(path, run_ranks) -> list[str]:
    return on_ranks(_moe_rank_guarded, path, run_ranks)


# ----------------------------------------------------------------------------------------------
# 8.1 Model states per rank under ZeRO
# ----------------------------------------------------------------------------------------------

def check_model_state_bytes(path, run_ranks=None) -> list[str]:
    try:
        with switched_off(STATES_OFF, student=path):
            student = load(path)
            return _model_state_problems(student)
    except NotImplementedYet as e:
        return [str(e)]
    except RuntimeError as e:
        return [f"raised RuntimeError: {e}"]


def _model_state_problems(student) -> list[str]:
    for widths in ((2, 2, 12), (4, 4, 8)):
        for psi, n, stage in itertools.product((1e9, 8.03e9), (1, 2, 8, 64), (0, 1, 2, 3)):
            got, want = attempt(student.model_state_bytes, psi, n, stage, *widths), model_state_bytes(psi, n, stage,
                                                                                                     *widths)
            if abs(float(got) - want) > 1e-9 * want:
                return [f"model_state_bytes(psi={psi:.3g}, n={n}, stage={stage}, weight, grad, k = {widths}) = "
                        f"{float(got):.4g}, the ZeRO paper's accounting gives {want:.4g}"]
    return []
