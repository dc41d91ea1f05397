"""How long a rank waits on its messages: the exposed communication of a step.

Chapter 1 of the course, after the ledger. A message costs the step only while the rank waits
for it: an all-reduce posted with async_op=True travels hidden while the rank computes; what is
left of it at the handle's wait() is exposed, and so is a blocking collective, whole.

Every torch.distributed call of collectives.py goes through `Group._call`, which hands it to the
ledger's clock when one is set (run/run_log.py sets one for training). The clock times the call
and wraps the work handles it returns, so that their wait() is timed too: by the host's clock on
gloo, by CUDA events on the compute stream on NCCL (no host wait added). The figure is summed per
kind of parallelism (`KINDS`: tp, cp, ep, pp, dp). Under a profiler the clock also names each
message in the trace ('..., posted #7', then its ', wait #7'). Read docs/01_collectives.md
("What a step waits for"), and docs/10_operating.md for the traces.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.profiler import record_function

KINDS = {"dp": "dp", "dp_cp": "dp", "edp": "dp", "dp_intra": "dp", "dp_cross": "dp", "tp": "tp", "cp": "cp",
         "pp": "pp", "pp_grad": "pp", "ep": "ep"}
ORDER = ("dp", "tp", "cp", "pp", "ep")  # the log's order; a group of another name follows, as itself
POSTING = ("isend", "irecv", "batch_isend_irecv")  # torch.distributed's calls that always return handles


class WaitClock:
    """The time this rank has waited in communication since `reset`, per group name."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        self.spans: list[tuple[str, Any, Any]] = []  # (group, start, end): perf_counter seconds, or CUDA events
        self.noted: list[str] | None = None  # profiling: the messages the ledger wrote since the last call
        self.posts = 0  # profiling: posted messages so far, to pair each with its wait in the trace

    def reset(self) -> None:
        self.spans.clear()

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: it fires when the stream gets there
        return event

    def waited(self, group: str, call: Callable, /, *args, **kwargs):
        """call(*args, **kwargs), its time kept as a wait of `group`."""
        start = self._now()
        result = call(*args, **kwargs)
        self.spans.append((group, start, self._now()))
        return result

    def note(self, group: str, op: str, ranks: tuple, peer: int | None, nbytes: int) -> None:
        """A ledger listener while profiling: the message (one of a batch) the next call posts."""
        self.noted.append(f"{group}/{op} {nbytes} B")

    def run(self, group: str, call: Callable, /, *args, **kwargs):
        """A torch.distributed call, timed; the work handle(s) it returns, if any, wrapped so that
        their wait() is timed as well. Profiling: the call and the wait inside named ranges."""
        call_range = wait_range = None
        if self.noted is not None:
            call_range = f"minipar {KINDS.get(group, group)}: {' + '.join(self.noted)}"
            self.noted.clear()
            if kwargs.get("async_op") or getattr(call, "__name__", "") in POSTING:  # a handle's wait() comes later
                self.posts += 1
                call_range, wait_range = f"{call_range}, posted #{self.posts}", f"{call_range}, wait #{self.posts}"
        with named(call_range):
            result = self.waited(group, call, *args, **kwargs)
        if isinstance(result, list):  # batch_isend_irecv's handles
            return [Timed(self, group, w, wait_range) for w in result]
        return None if result is None else Timed(self, group, result, wait_range)  # None: a blocking call

    def seconds(self) -> dict[str, float]:
        """Seconds waited per group. On CUDA, read it once the stream has passed the events."""
        waited: dict[str, float] = defaultdict(float)
        for group, start, end in self.spans:
            waited[group] += start.elapsed_time(end) / 1e3 if self.cuda else end - start
        return dict(waited)

    def by_kind(self) -> dict[str, float]:
        """Seconds waited per kind of parallelism, in the log's order: every kind that had a message."""
        waited: dict[str, float] = defaultdict(float)
        for group, seconds in self.seconds().items():
            waited[KINDS.get(group, group)] += seconds
        return {k: waited[k] for k in sorted(waited, key=lambda k: (ORDER.index(k) if k in ORDER else len(ORDER), k))}


class Timed:
    """A work handle whose wait() the clock times; anything else is the handle's own."""

    def __init__(self, clock: WaitClock, group: str, work, name: str | None = None):
        self.clock, self.group, self.work, self.name = clock, group, work, name  # name: its wait's range

    def wait(self, *args, **kwargs):
        with named(self.name):
            return self.clock.waited(self.group, self.work.wait, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def named(name: str | None):
    """A range of that name in the profiler's trace (None: no range, nothing done)."""
    return nullcontext() if name is None else record_function(name)


def exposed_line(by_kind: dict[str, float], step: float) -> str:
    """'comm exposed 38 ms of 120 ms (32%): dp 13 ms, tp 25 ms': the seconds waited, per kind, in a
    step of `step` seconds (a training log line, and train.py --plan's prediction beside it)."""
    def ms(seconds: float) -> str:  # 1,234 ms, 38 ms, 3.4 ms, 0.052 ms
        return f"{seconds * 1e3:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2g} ms"
    total = sum(by_kind.values())
    kinds = ", ".join(f"{k} {ms(s)}" for k, s in by_kind.items())
    return f"comm exposed {ms(total)} of {ms(step)} ({total / step:.0%})" + (f": {kinds}" if kinds else "")
