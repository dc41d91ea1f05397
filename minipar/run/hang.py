"""When a run hangs: what this rank waited for, in one line.

A rank that stops answering (stopped, dead, stuck in another step) leaves the others waiting in a
collective until --timeout. Each rank that gives up then says which operation it last asked of
others, on which group and with which number, and which ranks of that group never reached it:

    rank 0: no answer within --timeout 10 s; the last operation it asked of others was
    dp/all_reduce #7 with ranks [0, 1]: ranks [1] never reached it (at #6) ...

HangWatch listens to the mesh's Ledger (collectives.py), which only counts; `arrivals` compares
the ranks' counts through the store torch.distributed started with. launch.py turns the report
into exit code 4.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict

import torch.distributed as dist

from minipar.collectives import Ledger


class RankTimeout(RuntimeError):
    """Another rank did not answer within --timeout; the message names what this rank waited for."""


class HangWatch:
    """Listens to a Ledger: the last operation this rank asked of others, (group, op, its ranks,
    peer or None), and how many it has asked of each group; named if the job hangs."""

    def __init__(self, ledger: Ledger):
        self.last: tuple | None = None
        self.posted: dict[str, int] = defaultdict(int)
        ledger.listeners.append(self.heard)

    def heard(self, group: str, op: str, ranks: tuple, peer: int | None, nbytes: int) -> None:
        self.posted[group] += 1
        self.last = (group, op, ranks, peer)


# What gloo and NCCL say when the other end of a connection is gone (a rank killed, its machine lost).
LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")


def stopped_answering(error: Exception, why: tuple = ("timed out", "timeout", *LOST)) -> bool:
    """Whether a collective's error says another rank stopped answering (why=LOST: its end is gone)."""
    return any(w in str(error).lower() for w in why)


def hang_report(timeout: float, watch: HangWatch, error: Exception, wait: float = 2.0) -> str:
    """One line: which rank gave up, why (no answer within the timeout, or a peer's connection
    lost), the last operation it had asked of others, and (for a collective) which ranks of its
    group reached it: see `arrivals`."""
    rank, last, lost = dist.get_rank(), watch.last, stopped_answering(error, LOST)
    if last is None:
        return f"rank {rank}: a collective failed ({str(error).splitlines()[0][:200]})"
    group, op, ranks, peer = last
    wait = 0.2 if lost else wait  # a dead rank never says: torchrun is about to end this one too
    waits = f", from rank {peer}" if peer is not None else \
        f" #{watch.posted[group]} with ranks {list(ranks)}{arrivals(group, ranks, dict(watch.posted), wait)}"
    why = "a peer closed its connection" if lost else f"no answer within --timeout {timeout:g} s"
    return (f"rank {rank}: {why}; the last operation it asked of others was {group}/{op}{waits} (a rank there "
            f"stopped, died or runs a different step); the job stops")


def arrivals(group: str, ranks: tuple, posted: dict[str, int], wait: float) -> str:
    """Which ranks of `group` reached this rank's last operation on it. Each rank that gives up writes
    how many operations it has asked of each of its groups to the store torch.distributed started
    with, waits up to `wait` s for the others of `group`, and compares: a rank whose count is lower
    never reached the operation; one that wrote nothing stopped, died, or waits on another group.
    Bounded: the exchange runs in a thread given `wait` + 1 s (a stopped rank 0 holds the store)."""
    found: dict[int, int] = {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted run's keys are its own

    def exchange():
        try:
            store, me = dist.distributed_c10d._get_default_store(), dist.get_rank()
            store.set(f"minipar/hang/{attempt}/{me}", json.dumps(posted))
            keys = {r: f"minipar/hang/{attempt}/{r}" for r in ranks if r != me}
            deadline = time.monotonic() + wait
            while not store.check(list(keys.values())) and time.monotonic() < deadline:
                time.sleep(0.1)
            for r, key in keys.items():
                if store.check([key]):
                    found[r] = json.loads(store.get(key)).get(group, 0)
        except (RuntimeError, ValueError):  # the store went with its host: the ranks that did not say are named
            pass
    thread = threading.Thread(target=exchange, daemon=True)
    thread.start()
    thread.join(wait + 1)
    mine, found = posted[group], dict(found)  # a copy: the thread may still be writing
    behind = {r: n for r, n in sorted(found.items()) if n < mine}
    silent = [r for r in ranks if r != dist.get_rank() and r not in found]
    said = [f"ranks {list(behind)} never reached it (at #{', #'.join(map(str, behind.values()))})"] * bool(behind)
    said += [f"ranks {silent} did not say (stopped, died, or waiting on another group)"] * bool(silent)
    return f": {'; '.join(said)}" if said else ": every rank of the group reached it"
