"""Step 6b: ZB-V on paper: where its stages live, the order its builder produces, and what it costs.

    .venv/bin/python scripts/course/step_06b_zero_bubble_v.py

No process starts and no model runs: everything is the schedule as data (schedules.build) and the
unit-time simulation (timeline.simulate, F = B = W = 1 for the split schedules, F = 1 and B = 2
for 1F1B, so a micro-batch costs 3 units on every stage either way). It prints

(a) the V: which rank holds each of the 2p stages, and which messages stay on one rank;
(b) the smallest ZB-V, p = 2 and m = 2, action by action, with the simulated timeline;
(c) idle fraction and peak activations of 1F1B, ZB-H1 and ZB-V for a few p and m (peaks in whole-stage
    micro-batches: ZB-V's chunk holds half a rank's layers, so two chunk activations make one).

step_06_pipeline.py runs ZB-V on real ranks. Chapter: docs/06_pipeline.md.
"""

from minipar.pipeline.schedules import build, messages_of, peak_activations
from minipar.pipeline.timeline import simulate


def the_v(p: int) -> None:
    sched = build("zbv", p, 1)
    print(f"(a) the V at p = {p}: stage -> rank {list(sched.placement)}")
    for r in range(p):
        print(f"  rank {r} holds stages {[k for k, owner in enumerate(sched.placement) if owner == r]}")
    sends = [messages_of(a, sched.placement)[1] for acts in sched.actions for a in acts]
    local = sorted({(m.src, m.dst) for m in sends if m is not None and m.local})
    print(f"  stage pairs on one rank (a hand-over in memory, no message): {local}")


def smallest(p: int, m: int) -> None:
    sched = build("zbv", p, m)
    print(f"\n(b) ZB-V at p = {p}, m = {m}, in the order the builder produced (a: first chunk, b: second)")
    for r, acts in enumerate(sched.actions):
        print(f"  rank {r}: " + " ".join(f"{a.kind}{a.microbatch}(stage {a.stage})" for a in acts))
    sim = simulate(sched)
    print("  simulated, F = B = W = 1:")
    print("\n".join("  " + line for line in sim.ascii().splitlines()))
    print(f"  idle fraction {sim.idle_fraction():.1%}")


def compare(cases: list[tuple[int, int]]) -> None:
    print("\n(c) idle fraction (unit-time simulation) and peak activations (whole-stage micro-batches, the worst rank)")
    print(f"  {'p':>2} {'m':>3} | {'1f1b':>6} {'zb1':>6} {'zbv':>6} | {'1f1b':>5} {'zb1':>5} {'zbv':>5}")
    for p, m in cases:
        row = {}
        for name in ("1f1b", "zb1", "zbv"):
            sched = build(name, p, m)
            chunks = len(sched.placement) // p  # 2 for zbv: a chunk's activations are half a stage's
            row[name] = (simulate(sched).idle_fraction(), max(map(peak_activations, sched.actions)) / chunks)
        idle = " ".join(f"{row[n][0]:6.1%}" for n in row)
        peak = " ".join(f"{row[n][1]:5.1f}" for n in row)
        print(f"  {p:>2} {m:>3} | {idle} | {peak}")


if __name__ == "__main__":
    the_v(4)
    smallest(2, 2)
    compare([(2, 8), (4, 8), (4, 16), (8, 16), (8, 32)])
