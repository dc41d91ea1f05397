"""Step 4b: what each tensor-parallel message could hide behind, measured on one training step.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/course/step_04b_tp_overlap.py

minipar runs its tp collectives in sequence with the compute: a rank posts the all-reduce, waits
for it, and only then goes on. This script measures what overlapping them would be worth. It
profiles one forward and backward of the small Llama (2 layers, float32, batch [4, 128]) at tp =
world with torch.profiler, on rank 0 (three steps; the one whose messages took least), and prints

(a) the step's tp messages, from the ledger: forward (g of each region and the loss's three
    per-token sums) and backward (f of each region: the all-reduce of the input gradient);
(b) for each backward message, in the order autograd ran them: the compute since the message
    before, how much of it was weight-gradient matmuls (dW: nothing else in the backward reads
    them, so they could run while the message travels), the message's own time, and the smaller
    of the two: the time an overlapped backward would hide;
(c) the sum against the step, and a timeline of the backward as minipar runs it and as an
    overlapped backward would (a model built from the measured times, not a run).

A matmul is a weight gradient when it contracts over the tokens (b*s = 512, a size no weight
has). A message's time is gloo's, and includes any wait for the other rank to arrive.
Chapter: docs/04_tensor_parallel.md.
"""

import time

import torch
import torch.distributed as dist
from course_common import finish, leave, say, start_gloo
from torch.profiler import ProfilerActivity, profile

from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import parallelize

CFG = get_config("small", n_layers=2)
B, S = 4, 128
TOKENS = B * S  # the contracted size of a weight-gradient matmul
REPEATS = 3  # profiled steps; the one whose messages waited least is shown


def the_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))  # [b, s]
    return x, torch.roll(x, -1, dims=1)


def step(model, mesh: Mesh) -> tuple[list, list, float]:
    """One forward and backward; the ledger's trace of each half, and the step's wall time."""
    mesh.ledger.trace = []
    start = time.perf_counter()
    loss = model(*the_batch())
    forward, mesh.ledger.trace = mesh.ledger.trace, []
    loss.backward()
    backward, mesh.ledger.trace = mesh.ledger.trace, None
    return forward, backward, time.perf_counter() - start


def backward_regions(events, backward_start: float) -> list[dict]:
    """Walk rank 0's profiled backward in time order; one entry per tp message, with the compute
    (and the weight-gradient part of it) that autograd ran since the message before."""
    regions, compute, dw, n_dw = [], 0.0, 0.0, 0
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.time_range.start < backward_start:
            continue
        ms = e.time_range.elapsed_us() / 1e3
        if e.name.startswith("gloo:"):  # the collective itself, on gloo's worker thread
            regions.append(dict(compute=compute, dw=dw, n_dw=n_dw, message=ms))
            compute, dw, n_dw = 0.0, 0.0, 0
        elif e.name.startswith("autograd::engine::evaluate_function") and "Parallel" not in e.name:
            compute += ms  # every backward node, matmuls included; not f's, which is the wait itself
        elif e.name == "aten::mm" and e.input_shapes[0][-1] == TOKENS:  # [out, tokens] x [tokens, in]
            dw, n_dw = dw + ms, n_dw + 1
    return regions


def strip(regions: list[dict], overlapped: bool, cells: float) -> tuple[str, str]:
    """Two rows, compute and tp, of the backward: x other compute, w weight gradients, M a message."""
    work, comm = "", ""
    for r in regions:
        other = "x" * round((r["compute"] - r["dw"]) / cells)
        w, m = "w" * round(r["dw"] / cells), "M" * round(r["message"] / cells)
        if overlapped:  # the message starts when the input gradient is ready; the dW's run under it
            work += other + w + "." * max(0, len(m) - len(w))
            comm += "." * len(other) + m + "." * max(0, len(w) - len(m))
        else:
            work, comm = work + other + w + "." * len(m), comm + "." * (len(other) + len(w)) + m
    return work, comm


def main() -> None:
    start_gloo()
    mesh = Mesh.build(tp=dist.get_world_size())
    model = parallelize(Llama(CFG, seed=0), tp=mesh.groups().tp)
    step(model, mesh)  # warm-up: one-off start-up costs
    model.zero_grad(set_to_none=True)
    dist.barrier()
    forward, backward, seconds = step(model, mesh)  # timed without the profiler
    best = None
    for _ in range(REPEATS):  # other processes only ever make a run slower: keep the least-waiting one
        model.zero_grad(set_to_none=True)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            model(*the_batch()).backward()
        events = list(prof.events())
        first_bwd = min(e.time_range.start for e in events if e.name.startswith("autograd::engine::evaluate_function"))
        regions = backward_regions(events, first_bwd)
        if best is None or sum(r["message"] for r in regions) < sum(r["message"] for r in best):
            best = regions
    if dist.get_rank() != 0:
        return finish(mesh)
    regions = best
    say(f"small Llama, {CFG.n_layers} layers, dim {CFG.dim}, float32; batch [{B}, {S}]; tp = {mesh.groups().tp.size}; "
        "rank 0's view")
    say("\n(a) the step's tp messages (ledger)")
    for half, trace in (("forward", forward), ("backward", backward)):
        sizes = [t[-1] for t in trace]
        each = ", ".join(f"{sizes.count(n)} x {n:,} B" for n in sorted(set(sizes), reverse=True))
        say(f"  {half}: {len(trace)} {'/'.join(sorted({t[1] for t in trace}))}: {each}; {sum(sizes):,} B in all")
    names = ["LM head"] + [f"layer {i} {part}" for i in reversed(range(CFG.n_layers)) for part in ("MLP", "attention")]
    if len(regions) != len(names) or len(regions) != len(backward):
        raise SystemExit(f"step_04b: expected {len(names)} backward messages, the profile shows {len(regions)}")
    say("\n(b) the backward, message by message: the compute since the message before, its weight gradients, "
        "the message, what overlap could hide")
    for name, r, msg in zip(names, regions, backward):
        say(f"  f of {name:<18} {msg[-1]:,} B   compute {r['compute']:.2f} ms, "
            f"dW {r['dw']:.2f} ms ({r['n_dw']} matmul(s))   message {r['message']:.2f} ms   "
            f"could hide {min(r['dw'], r['message']):.2f} ms")
    hidden = sum(min(r["dw"], r["message"]) for r in regions)
    waiting = sum(r["message"] for r in regions)
    say(f"\n(c) minipar runs these in sequence: step {seconds * 1e3:.1f} ms (unprofiled), backward messages "
        f"{waiting:.2f} ms (profiled)")
    say(f"  overlapping each with its region's dW would hide {hidden:.2f} ms: measured {hidden / waiting:.0%} of "
        f"the backward's message time, {hidden / (seconds * 1e3):.0%} of the step (measured)")
    cells = sum(r["compute"] + r["message"] for r in regions) / 70
    for title, overlapped in (("in sequence, as minipar runs it", False), ("overlapped (a model)", True)):
        work, comm = strip(regions, overlapped, cells)
        say(f"  {title}, one cell = {cells:.2f} ms:\n    compute {work}\n    tp      {comm}")
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
