"""When ranks do not answer: one that never reaches the start, or stops mid-run, is named in one line.

A rank that stops answering (stopped, dead, stuck in another step) leaves the others waiting in a
collective until --timeout. Each rank that gives up then says which operation it last asked of
others, on which group and with which number, and which ranks of that group never reached it:

    rank 0: no answer within --timeout 10 s; the last operation it asked of others was
    dp/all_reduce #7 with ranks [0, 1]: ranks [1] never reached it (at #6) ...

HangWatch listens to the mesh's Ledger (collectives.py), which only counts; `arrivals` compares
the ranks' counts through the store torch.distributed started with. `start_distributed` names a
rank that never reaches the rendezvous (`join`). cli.py turns either into exit code 4.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist


class RankTimeout(RuntimeError):
    """Another rank did not answer within --timeout; the message names what this rank waited for."""


class HangWatch:
    """Listens to a Ledger: the last operation this rank asked of others, (group, op, its ranks,
    peer or None), and how many it has asked of each group; named if the job hangs."""

    def __init__(self):
        self.last: tuple | None = None
        self.posted: dict[str, int] = defaultdict(int)

    def listen(self, ledger) -> None:
        """From the ledger's next call on (cli.py: the mesh's, as launch.launch builds it)."""
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_distributed(timeout: float | None = None) -> torch.device:
    """NCCL on GPUs, gloo on CPU. Without torchrun, a world of one. timeout: seconds (None: torch's).
    Under torchrun, a rank that does not come is named within the timeout (`join`)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    limit = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if "RANK" in os.environ:
        if backend == "nccl":  # one GPU per local rank (ranks beyond the GPU count share them)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        join(lambda: dist.init_process_group(backend, **limit), timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **limit)
        if backend == "nccl":
            torch.cuda.set_device(0)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def join(start, timeout: float | None) -> None:
    """Run `start` (init_process_group), which waits at the rendezvous for every rank. Past
    --timeout it is a RankTimeout naming the rendezvous; should it wait on regardless (a store
    connection retried, gloo's mesh), a watchdog says the same line and ends the process."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "?")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    limit = "none" if timeout is None else f"{timeout:g} s"  # None: wait as long as torch does (benchmarks)
    line = (f"rank {rank}: the process group did not start within --timeout {limit}: the {world} ranks did "
            f"not all reach the rendezvous at {where} (a rank did not start, died, or has another --master-port)")
    done = threading.Event()

    def watchdog():
        if not done.wait(timeout + 15):
            print(f"minipar: error: {line}", file=sys.stderr, flush=True)
            os._exit(4)
    if timeout is not None:
        threading.Thread(target=watchdog, daemon=True).start()
    try:
        start()
    except (RuntimeError, ValueError) as e:  # DistStoreError, DistNetworkError: timed out or refused
        raise RankTimeout(f"{line} ({str(e).splitlines()[0][:160]})") from None
    finally:
        done.set()
