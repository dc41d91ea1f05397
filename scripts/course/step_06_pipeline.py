"""Step 6: pipeline parallelism, six schedules on paper and on real ranks.

    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_06_pipeline.py    (2 works too)
    options: --micro-batches 8 (m; must divide the 16 rows), --out runs/step_06 (the PNGs), --repeats 5

Every rank is one pipeline stage of the same 8-layer tiny Llama (float64, seed 0); the same batch
of 16 sequences is cut into m micro-batches. For naive (m = 1), GPipe, 1F1B, interleaved (v = 2),
ZB-H1 and ZB-V it shows:

(a) on paper (rank 0 alone, no model runs): the unit-time simulated timeline, the idle fraction
    the formula predicts, and how many micro-batches of activations each rank holds at its peak;
(b) on the ranks (Pipeline.run): the loss and the largest gradient difference against one device
    running the whole batch, the measured bubble next to the predicted one, and the measured
    timeline of every rank, gathered to rank 0 and drawn on the simulation's grid.

Each schedule runs once to warm up, then --repeats times (5); the fastest run is shown, since
other processes on the machine only ever make a run slower. PNGs of both timelines go to --out, a
new folder (one that holds anything is refused: an earlier run's PNGs are never drawn over).
Chapter: docs/06_pipeline.md.
"""

import argparse
import os
from contextlib import nullcontext
from pathlib import Path
from textwrap import indent

import torch
import torch.distributed as dist
from course_common import finish, leave, say, start_gloo, to_rank0

from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.ops.args import new_folder, unoccupied
from minipar.parallelize import parallelize
from minipar.pipeline.executor import Pipeline, stage_layers
from minipar.pipeline.schedules import bubble_formula, build, peak_activations
from minipar.pipeline.timeline import Timeline, simulate

CFG = get_config("tiny", n_layers=8)
SEED, ROWS, SEQ = 0, 16, 32


def the_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))  # [B, s]
    return x, torch.roll(x, -1, dims=1)  # targets: the next token


def single_device() -> tuple[float, dict[str, torch.Tensor]]:
    model = Llama(CFG, seed=SEED).double()
    loss = model(*the_batch())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def predicted(name: str, p: int, m: int, v: int, sim: Timeline) -> tuple[float, str]:
    """The idle fraction theory gives, and where the number comes from."""
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1)"
    if name == "zb1":  # F = B = W = 1: the W's fill 1F1B's idle slots (schedules.zero_bubble_h1)
        return (p - 1) / (3 * m + p - 1), "(p-1)/(3m+p-1), the paper's (p-1)/(3m) as an idle fraction"
    if name == "zbv":  # a greedy construction (schedules.zero_bubble_v): no closed form to quote
        return sim.idle_fraction(), "the simulation's own (no closed form)"
    return bubble_formula(p, m), "(p-1)/(m+p-1)"


def on_paper(name: str, p: int, m: int, v: int, out: Path) -> tuple[Timeline, float]:
    sched = build(name, p, m, v)
    sim = simulate(sched)
    theory, source = predicted(name, p, m, v, sim)
    peaks = [peak_activations(acts) for acts in sched.actions]
    chunks = len(sched.placement) // p  # v for interleaved, 2 for zbv's V, else 1
    split = name in ("zb1", "zbv")  # the backward split into B and W
    say(f"\n(a) on paper: unit-time simulation ({'F = B = W = 1' if split else 'F = 1, B = 2'})")
    say(indent(sim.ascii(), "  "))
    say(f"  idle fraction: theory {theory:.1%} {source}, simulated {sim.idle_fraction():.1%}")
    if chunks > 1:  # a chunk holds 1/chunks of a rank's layers, so its activations are that much smaller
        say(f"  peak activations per rank, in micro-batch-chunks: {peaks} "
            f"= {[k / chunks for k in peaks]} of a whole stage's micro-batch")
    else:
        say(f"  peak activations per rank, in micro-batches: {peaks}")
    # pipeline.bubble's count: each rank from the step's start to its own last action (see on_ranks)
    t0 = min(s for row in sim.rows for s, _, _ in row)
    own = [1 - sum(e - s for s, e, _ in row) / (max(e for _, e, _ in row) - t0) for row in sim.rows]
    say(f"  each rank's idle up to its own end (pipeline.bubble): {', '.join(f'{b:.1%}' for b in own)}, "
        f"mean {sum(own) / len(own):.1%}")
    sim.draw(str(out / f"{name}_simulated.png"), f"{name}, p={p} m={m}: simulated, idle {sim.idle_fraction():.1%}")
    return sim, theory


def on_ranks(name: str, m: int, v: int, mesh: Mesh, ref, sim: Timeline, theory: float, out: Path,
             repeats: int) -> None:
    # Activations on the pp group, gradients on a second group over the same ranks, as train.py does.
    pipeline = Pipeline(mesh.groups().pp, name, CFG.n_layers, v, grad_group=mesh.group("pp", channel="grad"))
    stage = (pipeline.my_layers(), pipeline.holds_first(), pipeline.holds_last())  # layers, embedding?, head?
    model = parallelize(Llama(CFG, seed=SEED), stage=stage).double()  # only this rank's stages
    x, y = the_batch()
    micro = list(zip(x.chunk(m), y.chunk(m)))  # m x ([B/m, s], [B/m, s])
    best = None
    for run in range(1 + repeats):  # a warm-up run (one-off start-up costs), then the measured ones
        model.zero_grad(set_to_none=True)
        dist.barrier()  # start together, so no rank's wait is an earlier rank's set-up
        loss = pipeline.run(model, micro, y.numel())  # the batch's mean: sum of token losses / B s
        span = torch.tensor(pipeline.timeline.makespan)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the run's length: its slowest rank
        if run and (best is None or span < best[0]):  # every rank keeps the same run: the fastest
            best = (span, pipeline.timeline.rows[0], pipeline.bubble)
    mine = dict(loss=float(loss) if pipeline.holds_last() else None, layers=pipeline.my_layers(),
                grads={n: p.grad for n, p in model.named_parameters()}, row=best[1], bubble=best[2])
    ranks = to_rank0(mine)
    if dist.get_rank() != 0:
        return
    ref_loss, ref_grads = ref
    loss = next(r["loss"] for r in ranks if r["loss"] is not None)
    grads = {n: g for r in ranks for n, g in r["grads"].items()}
    worst = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    assert grads.keys() == ref_grads.keys()  # every parameter on exactly one stage
    print(f"\n(b) on {len(ranks)} ranks, layers per rank: {[r['layers'] for r in ranks]}")
    print(f"  loss {loss:.12f}   one device {ref_loss:.12f}   |diff| {abs(loss - ref_loss):.1e}   "
          f"max |grad - one device| {worst:.1e}")
    measured = Timeline([r["row"] for r in ranks])
    # pipeline.bubble runs from a rank's own start to its own end, so a rank that finishes early
    # does not count its wait for the others: the mean is below the idle fraction of the whole.
    bubbles = [r["bubble"] for r in ranks]
    print(f"  idle: theory {theory:.1%}   measured {measured.idle_fraction():.1%} (all ranks' timeline)   "
          f"pipeline.bubble mean {sum(bubbles) / len(bubbles):.1%} ({', '.join(f'{b:.0%}' for b in bubbles)})")
    # The same schedule on paper, each (kind, stage) at its measured median time: what the stages'
    # unequal costs alone explain; what the measured run idles beyond it is the wire and the executor.
    replay = simulate(build(name, len(ranks), m, v), measured.costs()).idle_fraction()
    print(f"  simulated with the measured time of each stage's F, B, W: idle {replay:.1%} "
          f"(the rest of the measured idle: messages, the executor, ranks sharing a core)")
    unit = measured.makespan / round(sim.makespan)  # as many cells as the simulation
    # ascii() gives an action as many cells as it lasts, rounded: a short one would get none.
    shown = Timeline([[(s, max(e, s + unit), a) for s, e, a in row] for row in measured.rows])
    print(f"  measured timeline, one cell = {unit * 1e3:.2f} ms (run {measured.makespan * 1e3:.1f} ms); "
          "an action shorter than a cell gets one, and of two in a cell the later shows:")
    print(indent(shown.ascii(unit), "  "))
    for r, row in enumerate(measured.rows):
        ms = {k: sum(e - s for s, e, a in row if a.kind == k) * 1e3 for k in "FBW"}
        print(f"  rank {r}: busy " + "  ".join(f"{k} {t:.1f} ms" for k, t in ms.items() if t))
    # draw() scales the figure by the shortest action: leave out the empty ones (under ZB-H1, stage
    # 0's B only receives a gradient, it has no input gradient to compute) or the PNG is miles wide.
    drawn = Timeline([[(s, e, a) for s, e, a in row if e - s > measured.makespan / 1000] for row in measured.rows])
    drawn.draw(str(out / f"{name}_measured.png"),
               f"{name}, p={len(ranks)} m={m}: measured, idle {measured.idle_fraction():.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=8, help="m for every schedule but naive")
    parser.add_argument("--out", default="runs/step_06", help="a new folder for the timeline PNGs")
    parser.add_argument("--repeats", type=int, default=5, help="measured runs per schedule; the fastest is shown")
    args = parser.parse_args()
    start_gloo()
    p, m, out = dist.get_world_size(), args.micro_batches, Path(args.out)
    plan = [("naive", 1, 1), ("gpipe", m, 1), ("1f1b", m, 1), ("interleaved", m, 2), ("zb1", m, 1), ("zbv", m, 1)]
    try:  # every rank checks every schedule first, so a bad size stops all of them, not just rank 0
        unoccupied(out, "--out")  # an earlier run's PNGs are never drawn over
        if ROWS % m or args.repeats < 1:
            raise ValueError(f"--micro-batches {m} must divide the {ROWS} rows and --repeats be at least 1")
        for name, m_, v in plan:
            stage_layers(CFG.n_layers, build(name, p, m_, v).n_stages)  # zbv: 2p stages
    except ValueError as e:  # ScheduleError is a ValueError too
        say(f"step_06: {e}")
        raise SystemExit(2) from None
    mesh = Mesh.build(pp=p)  # one pipeline group of every rank; rank r is stage r
    ref = single_device() if dist.get_rank() == 0 else None
    say(f"tiny Llama, {CFG.n_layers} layers, float64; batch [{ROWS}, {SEQ}]; pp = {p}; "
        f"F(i) forward, B(i) backward, W(i) weight gradient of micro-batch i; '.' idle")
    if p > (os.cpu_count() or 1):
        say(f"note: {p} ranks share {os.cpu_count()} CPU cores: measured bubbles include time spent "
            "waiting for a core, not only for a neighbour")
    # Rank 0 draws into a temporary folder beside --out, renamed to it at the end.
    with new_folder(out, "--out") if dist.get_rank() == 0 else nullcontext(out) as folder:
        for name, m_, v in plan:
            chunks = "2 chunks per rank in a V" if name == "zbv" else f"v = {v} chunks per rank" if v > 1 else ""
            say(f"\n=== {name}: m = {m_}" + (f", {chunks} (a/b: first/second chunk)" if chunks else ""))
            sim, theory = on_paper(name, p, m_, v, folder) if dist.get_rank() == 0 else (None, None)
            on_ranks(name, m_, v, mesh, ref, sim, theory, folder, args.repeats)
    say(f"\nPNGs: {out}/<schedule>_simulated.png and <schedule>_measured.png")
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
