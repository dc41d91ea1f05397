"""Checkers of the exercises that build a piece of a model, a layer or a schedule: 0.1 counting
the activations, 4.1 the column/row pair and 7.1 top-k routing by all-to-all (on gloo ranks), 5.1
the zigzag, 6.1 GPipe's action list and 8.1 the model states per rank (in one process).
"""

from __future__ import annotations

import itertools

import torch
from check_common import NotImplementedYet, attempt, guarded, in_process, load, max_diff, on_ranks, world_group

# ----------------------------------------------------------------------------------------------
# 4.1 Column-parallel then row-parallel linear
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
    y = attempt(student.column_row_mlp, xs, w1, w2, world_group("tp"))
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


_tp_rank_guarded = guarded(_tp_rank)


def check_column_row(path, run_ranks) -> list[str]:
    return on_ranks(_tp_rank_guarded, path, run_ranks)


# ----------------------------------------------------------------------------------------------
# 6.1 GPipe's action list (one process: a schedule is data)
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
# 5.1 Zigzag chunks for context parallelism
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
# 0.1 The bytes autograd keeps for backward
# ----------------------------------------------------------------------------------------------

@in_process
def check_activation_bytes(student) -> list[str]:
    from minipar.model import Llama, get_config
    from minipar.planning.estimate import activation_bytes
    from minipar.run.config import TrainConfig

    for model, batch, seq_len in (("tiny", 2, 16), ("tiny", 1, 64)):
        c = get_config(model)
        cfg = TrainConfig(model=model, seq_len=seq_len, micro_batch=batch, global_batch=batch, dtype="float32")
        tokens = torch.randint(0, c.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
        got, want = attempt(student.saved_activation_bytes, Llama(c, seed=0), tokens), activation_bytes(c, cfg)
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

    from minipar.moe import MoE
    cfg = SimpleNamespace(n_experts=MOE_EXPERTS, top_k=MOE_TOP_K, router="softmax", capacity_factor=0.0,
                          aux_loss_coef=0.0, dim=MOE_DIM, expert_ffn_dim=MOE_FFN, n_shared_experts=0)
    torch.manual_seed(4)
    moe = MoE(cfg).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def _moe_rank(rank, world, student):
    import torch.distributed as dist

    from minipar.moe import Experts
    moe = _plain_moe()
    x = torch.randn(world * MOE_TOKENS, MOE_DIM, dtype=torch.float64, requires_grad=True)  # [N*T, d]
    dy = torch.randn(world * MOE_TOKENS, MOE_DIM, dtype=torch.float64)
    moe(x).backward(dy)
    rows, n = slice(rank * MOE_TOKENS, (rank + 1) * MOE_TOKENS), MOE_EXPERTS // world
    router = torch.nn.Linear(MOE_DIM, MOE_EXPERTS, bias=False).double()
    experts = Experts(n, MOE_DIM, MOE_FFN).double()
    with torch.no_grad():
        router.weight.copy_(moe.router.weight)
        for name, p in experts.named_parameters():
            p.copy_(getattr(moe.experts, name)[rank * n : (rank + 1) * n])
    xs = x.detach()[rows].clone().requires_grad_()
    where = f"rank {rank}: ep={world} ({n} experts each)"
    y = attempt(student.expert_parallel_moe, xs, router, experts, MOE_TOP_K, world_group("ep"))
    with torch.no_grad():
        y_ref = moe(x.detach())[rows]
    if y.shape != y_ref.shape or not torch.allclose(y, y_ref, rtol=1e-10, atol=1e-12):
        return {"problems": [f"{where}: the output differs from the plain MoE layer's on one device: "
                             f"{max_diff(y, y_ref)}"]}
    y.backward(dy[rows])
    dist.all_reduce(router.weight.grad)  # each rank's tokens give part of the router's gradient
    pairs = [("x.grad", xs.grad, x.grad[rows]), ("router.weight.grad (summed over ranks)", router.weight.grad,
                                                 moe.router.weight.grad)]
    pairs += [(f"experts.{k}.grad", p.grad, getattr(moe.experts, k).grad[rank * n : (rank + 1) * n])
              for k, p in experts.named_parameters()]
    for name, got, want in pairs:
        if got is None or not torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            return {"problems": [f"{where}: {name} differs from one device's: "
                                 f"{'None' if got is None else max_diff(got, want)}"]}
    return {"problems": []}


_moe_rank_guarded = guarded(_moe_rank)


def check_moe_all_to_all(path, run_ranks) -> list[str]:
    return on_ranks(_moe_rank_guarded, path, run_ranks)


# ----------------------------------------------------------------------------------------------
# 8.1 Model states per rank under ZeRO
# ----------------------------------------------------------------------------------------------

@in_process
def check_model_state_bytes(student) -> list[str]:
    from minipar.zero import model_state_bytes

    for widths in ((2, 2, 12), (4, 4, 8)):
        for psi, n, stage in itertools.product((1e9, 8.03e9), (1, 2, 8, 64), (0, 1, 2, 3)):
            got, want = attempt(student.model_state_bytes, psi, n, stage, *widths), model_state_bytes(psi, n, stage,
                                                                                                     *widths)
            if abs(float(got) - want) > 1e-9 * want:
                return [f"model_state_bytes(psi={psi:.3g}, n={n}, stage={stage}, weight, grad, k = {widths}) = "
                        f"{float(got):.4g}, the ZeRO paper's accounting gives {want:.4g}"]
    return []
