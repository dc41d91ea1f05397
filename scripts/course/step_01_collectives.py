"""Step 1: the collectives, seen from every rank, and the bytes they cost.

    .venv/bin/torchrun --nproc-per-node 4 scripts/course/step_01_collectives.py     (or 2: any power of two)

Part 1 gives every rank a small tensor (rank r holds [10r, 10r+1, ...]) and runs each operation of
minipar/collectives.py on it, printing what every rank holds before and after.

Part 1 ends with the four operations training rarely needs: reduce and gather (onto a root),
scatter (from one), and barrier (no data at all).

Part 2 runs each operation on 1 MiB of float32 and prints the ledger's payload and sent bytes per
rank next to the textbook ring formula, 2(N-1)/N * S or (N-1)/N * S. Then it runs
`ring_all_reduce`, the all-reduce written with send/recv, counts what it really sent, and checks
that its result is the all-reduce's.

Part 3 times an all-reduce of 4 bytes to 4 MiB on this machine (each size 20 times after a
warm-up; the fastest run of each rank, then the slowest rank) and fits the classic time model of
a ring all-reduce, t = 2(N-1) * alpha + beta * (bytes each rank sends): alpha the latency of one
ring step (a message to the next rank), beta the time per byte. On N ranks every size pays the
same 2(N-1) steps, so the fit finds their sum, one call's latency, and divides it by 2(N-1). The
fit weighs every size by 1/t^2 (it minimises the relative error), so the small sizes, which only
the latency explains, count as much as the large ones. The times are this machine's and vary from
run to run; the sizes and the formula do not.

Chapter: docs/01_collectives.md.
"""

import time

import torch
import torch.distributed as dist
from course_common import each_rank, finish, leave, say, start_gloo

from minipar import collectives as C
from minipar.mesh import Mesh


def fmt(t: torch.Tensor | None) -> str:
    if t is None:
        return "(nothing: not the root)"
    return "[" + " ".join(f"{v:>3.0f}" for v in t.tolist()) + "]"


def show(title: str, before: torch.Tensor, after: torch.Tensor) -> None:
    """Print, on rank 0 and in rank order, what every rank held before and after an operation."""
    each_rank(f"\n{title}", f" {fmt(before):<{5 * before.numel()}}  ->  {fmt(after)}")


def part1_who_holds_what(group: C.Group) -> None:
    n, r = group.size, group.rank
    x = torch.tensor([10.0 * r + j for j in range(n)])  # [n]: rank r holds 10r, 10r+1, ...

    t = x.clone()
    C.all_reduce(t, group)
    show("all_reduce (sum): every rank gets the element-wise sum", x, t)

    show("all_gather: every rank gets all tensors, in rank order", x, C.all_gather(x, group))

    show("reduce_scatter: rank i gets the sum of everyone's element i", x, C.reduce_scatter(x, group))

    t = x.clone()
    C.broadcast(t, group, src=0)
    show("broadcast from rank 0: every rank gets rank 0's tensor", x, t)

    show("all_to_all: element j of rank i goes to rank j (a transpose)", x, C.all_to_all(x, group))

    # Send/recv around a ring: each rank sends to its right and receives from its left. Even ranks
    # send first and odd ranks receive first, so two neighbours never both wait in send.
    t = torch.empty_like(x)
    right, left = (r + 1) % n, (r - 1) % n
    if r % 2 == 0:
        C.send(x, group, right)
        C.recv(t, group, left)
    else:
        C.recv(t, group, left)
        C.send(x, group, right)
    show("send to the right, recv from the left: every tensor moves one rank along the ring", x, t)

    t = x.clone()
    C.ring_all_reduce(t, group)
    show("ring_all_reduce (send/recv only): the same result as all_reduce", x, t)

    show("reduce (sum) to rank 0: only the root gets the sum", x, C.reduce(x.clone(), group, dst=0))
    show("gather to rank 0: only the root gets all tensors", x, C.gather(x, group, dst=0))
    show("scatter from rank 0: rank i gets element i of rank 0's tensor", x, C.scatter(x, group, src=0))
    C.barrier(group)
    say("\nbarrier: no data moves; every rank waits until all have called it (ledger: 1 call, 0 bytes)")


def part2_bytes(group: C.Group, ledger: C.Ledger) -> None:
    n = group.size
    numel = 2**18  # 1 MiB of float32
    if numel % n:
        raise SystemExit(f"part 2 cuts {numel} elements into {n} chunks: launch with a power of two ranks")
    g = torch.Generator().manual_seed(dist.get_rank())
    # Whole numbers, so every order of summation gives the same float32 sum: results compare exactly.
    x = torch.randint(-100, 100, (numel,), generator=g).float()  # [numel]
    S = x.numel() * x.element_size()

    ops = {  # name -> (run it, textbook bytes each rank sends by the ring algorithm, in words)
        "all_reduce": (lambda: C.all_reduce(x.clone(), group), 2 * (n - 1) / n * S, "2(N-1)/N * S"),
        "all_gather": (lambda: C.all_gather(x[: numel // n], group), (n - 1) / n * S, "(N-1)/N * S"),
        "reduce_scatter": (lambda: C.reduce_scatter(x, group), (n - 1) / n * S, "(N-1)/N * S"),
        "all_to_all": (lambda: C.all_to_all(x, group), (n - 1) / n * S, "(N-1)/N * S"),
        "broadcast": (lambda: C.broadcast(x.clone(), group), S, "S"),
    }
    rows = []
    for op, (run, formula, words) in ops.items():
        ledger.reset()
        run()
        e = ledger.get(group.name, op)
        rows.append(f"  {op:<16}{e.calls:>6}{e.bytes:>15,}{e.sent:>13,}   {words:<14}= {formula:>11,.0f}")

    # The ring, written with send/recv: count the bytes it really sends.
    expected = x.clone()
    C.all_reduce(expected, group)
    ledger.reset()
    t = x.clone()
    C.ring_all_reduce(t, group)
    sends, recvs = ledger.get(group.name, "send"), ledger.get(group.name, "recv")
    ring_formula = 2 * (n - 1) / n * S
    ring = [
        f"  send entries: {sends.calls} calls of {sends.bytes // sends.calls:,} bytes (S/N), "
        f"{sends.sent:,} bytes sent",
        f"  recv entries: {recvs.calls} calls, {recvs.bytes:,} bytes received",
        f"  textbook 2(N-1)/N * S = {ring_formula:,.0f} bytes   equal: {sends.sent == ring_formula}",
        f"  ring_all_reduce result equals all_reduce, element for element: {torch.equal(t, expected)}",
    ]

    # Every rank's ledger says the same (each rank sends the same amount in a ring); check it.
    all_rows = [None] * n
    dist.all_gather_object(all_rows, (rows, ring))
    if dist.get_rank() == 0:
        print(f"\n\nBytes per rank, S = {S:,} bytes (1 MiB of float32), N = {n} ranks")
        print(f"  {'op':<16}{'calls':>6}{'payload bytes':>15}{'sent bytes':>13}   textbook ring formula")
        print("\n".join(rows))
        print("\nring_all_reduce on S, from the ledger's send/recv entries (rank 0)")
        print("\n".join(ring))
        print(f"\nevery rank's ledger shows the same numbers: {all(r == all_rows[0] for r in all_rows)}")


def part3_alpha_beta(group: C.Group) -> None:
    n, repeats = group.size, 20
    sizes = [4 * 4**k for k in range(11)]  # 4 B, 16 B, ..., 4 MiB
    measured = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)  # [S/4] float32
        best = float("inf")
        for run in range(2 + repeats):  # two warm-up calls, then the timed ones
            dist.barrier(group=group.pg)  # start together: no rank's time includes another's lateness
            start = time.perf_counter()
            C.all_reduce(x, group)
            if run >= 2:
                best = min(best, time.perf_counter() - start)
        slowest = torch.tensor([best], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group.pg)  # the op ends when its last rank does
        measured.append(slowest.item())
    sent = [C.ring_bytes_sent("all_reduce", b, n) for b in sizes]
    # Weighted least squares for t = latency + beta * sent, weights 1/t^2: the 2x2 normal equations.
    w = [1 / t**2 for t in measured]
    sw, sx, sxx = sum(w), sum(wi * x for wi, x in zip(w, sent)), sum(wi * x * x for wi, x in zip(w, sent))
    sy, sxy = sum(wi * t for wi, t in zip(w, measured)), sum(wi * x * t for wi, x, t in zip(w, sent, measured))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    latency = (sy - beta * sx) / sw  # one call's: the ring's 2(N-1) steps, each an alpha
    steps = 2 * (n - 1)
    alpha = latency / steps
    barrier = float("inf")
    for _ in range(repeats):  # the fastest barrier, as for the all-reduces
        start = time.perf_counter()
        dist.barrier(group=group.pg)
        barrier = min(barrier, time.perf_counter() - start)
    say(f"\n\nTime of one all_reduce on {n} ranks (gloo, float32), fastest of {repeats}, slowest rank")
    say(f"  {'S bytes':>12}{'sent bytes':>13}{'measured':>12}{'model':>12}")
    for nbytes, x, t in zip(sizes, sent, measured):
        say(f"  {nbytes:>12,}{x:>13,}{t * 1e6:>9.1f} µs{(steps * alpha + beta * x) * 1e6:>9.1f} µs")
    say(f"  fitted t = 2(N-1) alpha + beta * sent, with 2(N-1) = {steps} ring steps on {n} ranks:")
    say(f"    alpha {alpha * 1e6:.1f} µs per step ({latency * 1e6:.1f} µs per call), "
        f"beta {beta * 1e9:.3f} ns per byte ({1 / beta / 1e9:.2f} GB/s)")
    say(f"  barrier (no bytes, one round of messages), fastest of {repeats} on rank 0: {barrier * 1e6:.1f} µs")


def main() -> None:
    start_gloo()
    mesh = Mesh.build(dp=dist.get_world_size())  # one group of every rank; its name in the ledger: "dp"
    say(mesh.layout.table())
    part1_who_holds_what(mesh.groups().dp)
    part2_bytes(mesh.groups().dp, mesh.ledger)
    part3_alpha_beta(mesh.groups().dp)
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
