"""NCCL's two ordering rules, checked on the traces of a run (any backend, gloo included).

NCCL is stricter than gloo in two ways that a CPU run does not show by itself:

  1. Point-to-point messages are matched by posting order alone. NCCL ignores tags: the k-th send
     that rank a posts to rank b on a communicator meets the k-th receive that b posts from a on
     it. If a sends x then y while b asks for y then x, and the two have the same size, b gets
     each other's data silently; of different sizes, the run hangs or fails.
  2. Collectives are matched by their position on the communicator: every rank of it must issue
     the same collectives, of the same sizes, in the same order.

Turn on the ledger's trace (`mesh.ledger.trace = []`: collectives.py), run a step on every rank,
gather the traces, and `order_problems(traces)` lists every break of either rule: an empty list is
the proof. The test suite does this for every pipeline schedule, the context-parallel ring and
ZeRO-3's prefetch (tests/test_order_check.py). minipar's point-to-point calls pass no tags, so gloo
matches messages by order too and every CPU test runs under NCCL's rule 1.
"""

from __future__ import annotations

from collections import defaultdict

P2P = ("send", "recv")


def order_problems(traces: list[list[tuple]]) -> list[str]:
    """traces[r]: rank r's (communicator, op, peer, bytes) in posting order, communicator being
    (name, ranks). Returns what breaks NCCL's rules, one line each (empty: none)."""
    sends, recvs = defaultdict(list), defaultdict(list)  # (communicator, from, to) -> [bytes, ...]
    collectives = defaultdict(dict)  # communicator -> {rank: [(op, bytes), ...]}
    for rank, trace in enumerate(traces):
        for communicator, op, peer, nbytes in trace:
            if op == "send":
                sends[communicator, rank, peer].append(nbytes)
            elif op == "recv":
                recvs[communicator, peer, rank].append(nbytes)
            else:  # an all-to-all's size differs from rank to rank (uneven splits, experts): not compared
                collectives[communicator].setdefault(rank, []).append((op, None if op == "all_to_all" else nbytes))
    problems = []
    for key in sorted(sends.keys() | recvs.keys()):
        sent, received = sends.get(key, []), recvs.get(key, [])
        if sent != received:
            (name, _), a, b = key
            problems.append(f"{name}: rank {a} sends {_short(sent)} bytes to rank {b}, which "
                            f"receives {_short(received)} from it")
    for (name, members), per_rank in sorted(collectives.items()):
        first_rank, first = min(per_rank.items())
        for rank in members:  # a member that issued nothing is out of step too
            ops = per_rank.get(rank, [])
            if ops != first:
                at = next((i for i, (x, y) in enumerate(zip(ops, first)) if x != y), min(len(ops), len(first)))
                problems.append(f"{name}{list(members)}: rank {rank}'s collective #{at} is {_at(ops, at)}, rank "
                                f"{first_rank}'s is {_at(first, at)}")
    return problems


def _short(sizes: list[int]) -> str:
    return str(sizes) if len(sizes) <= 8 else f"{sizes[:8]} ... ({len(sizes)} messages)"


def _at(ops: list[tuple], i: int) -> str:
    if i >= len(ops):
        return "missing"
    return ops[i][0] if ops[i][1] is None else f"{ops[i][0]} of {ops[i][1]} bytes"
