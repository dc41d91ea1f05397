"""The clock of exposed communication (minipar/comm_clock.py): it times a blocking call and a
handle's wait, not the time a posted message travels meanwhile; it sums groups into kinds in the
log's order; on CUDA it reads events and adds no host wait; and every torch.distributed call of
collectives.py goes through it (a call that did not would be missing from every step's figure).
A real run's waits, group by group against the ledger, are checked in test_ledger.py."""

import ast
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from minipar import comm_clock
from minipar.comm_clock import WaitClock, exposed_line

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """Pretend time, for comm_clock's time.perf_counter: it moves only when a test says so."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class FakeWork:
    """A posted message that arrives `travel` seconds after it was posted."""

    def __init__(self, clock: Clock, travel: float):
        self.clock, self.arrives = clock, clock.now + travel

    def wait(self):
        self.clock.now = max(self.clock.now, self.arrives)
        return True

    def is_completed(self):
        return self.clock.now >= self.arrives


def test_a_blocking_call_is_exposed_whole_and_a_handle_only_for_its_wait(monkeypatch):
    now = Clock()
    monkeypatch.setattr(comm_clock, "time", now)
    clock = WaitClock()
    assert clock.run("tp", now.sleep, 0.05) is None  # a blocking call: its whole time is a wait
    work = clock.run("dp", FakeWork, now, 0.1)  # posted: it travels 0.1 s
    assert not work.is_completed()  # the handle's own methods pass through the wrapper
    now.sleep(0.08)  # computing meanwhile: 0.08 s of the message's flight hidden
    assert work.wait() is True
    assert clock.seconds() == pytest.approx({"tp": 0.05, "dp": 0.02})  # exposed: what was left to wait for
    works = clock.run("cp", lambda: [FakeWork(now, 0.01), FakeWork(now, 0.03)])  # batch_isend_irecv's handles
    assert [w.wait() for w in works] == [True, True] and clock.seconds()["cp"] == pytest.approx(0.03)
    clock.reset()
    assert clock.seconds() == {} and clock.by_kind() == {}


def test_groups_are_summed_into_kinds_in_the_logs_order():
    clock = WaitClock()
    clock.spans += [("pp_grad", 0.0, 0.004), ("tp", 0.0, 0.025), ("dp_cp", 0.0, 0.010), ("pp", 0.0, 0.001),
                    ("dp_cross", 0.0, 0.002), ("edp", 0.0, 0.001), ("ep", 0.0, 0.003), ("custom", 0.0, 0.5)]
    kinds = clock.by_kind()
    assert list(kinds) == ["dp", "tp", "pp", "ep", "custom"]  # a group of no known kind follows, as itself
    assert (kinds["dp"], kinds["pp"]) == pytest.approx((0.013, 0.005))


def test_the_line_says_the_exposed_time_its_share_and_each_kind():
    assert exposed_line({"dp": 0.013, "tp": 0.025}, 0.120) == "comm exposed 38 ms of 120 ms (32%): dp 13 ms, tp 25 ms"
    assert exposed_line({"dp": 0.0034}, 2.5) == "comm exposed 3.4 ms of 2,500 ms (0%): dp 3.4 ms"
    assert exposed_line({}, 0.1) == "comm exposed 0 ms of 100 ms (0%)"  # one rank: nothing to wait for


def test_under_a_profiler_each_call_and_wait_is_a_range_named_for_its_messages(monkeypatch):
    ranges = []
    monkeypatch.setattr(comm_clock, "record_function", lambda name: ranges.append(name) or nullcontext())
    clock, now = WaitClock(), Clock()

    def batch_isend_irecv():  # torch.distributed's, by name: it always returns handles, waited later
        return [FakeWork(now, 0.01), FakeWork(now, 0.02)]

    def all_reduce(async_op):
        return FakeWork(now, 0.1) if async_op else None
    clock.run("tp", now.sleep, 0.01)
    clock.run("dp", all_reduce, async_op=True).wait()
    assert ranges == []  # no profiler: no names, no ranges
    clock.noted = []  # as profiling.StepProfiler sets it, with clock.note listening to the ledger
    clock.note("tp", "all_reduce", (0, 1), None, 128)
    clock.run("tp", now.sleep, 0.01)
    clock.note("dp_cp", "all_reduce", (0, 1), None, 4096)
    clock.run("dp_cp", all_reduce, async_op=True).wait()
    clock.note("cp", "send", (0, 1), 1, 64)
    clock.note("cp", "recv", (0, 1), 1, 64)
    [w.wait() for w in clock.run("cp", batch_isend_irecv)]
    batch = "minipar cp: cp/send 64 B + cp/recv 64 B"  # one call, two messages, two handles
    assert ranges == ["minipar tp: tp/all_reduce 128 B",  # a blocking call: exposed whole
                      "minipar dp: dp_cp/all_reduce 4096 B, posted #1", "minipar dp: dp_cp/all_reduce 4096 B, wait #1",
                      f"{batch}, posted #2", f"{batch}, wait #2", f"{batch}, wait #2"]
    assert clock.noted == []


class FakeEvent:
    """torch.cuda.Event on a pretend stream: each record is 2 ms of stream time after the last."""

    stream_ms = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        FakeEvent.stream_ms += 2.0
        self.at = FakeEvent.stream_ms

    def elapsed_time(self, end):
        return end.at - self.at


def test_on_cuda_the_clock_reads_events_of_the_stream_and_adds_no_host_wait(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (_ for _ in ()).throw(AssertionError("a host wait")))
    clock = WaitClock(cuda=True)
    clock.run("tp", lambda: None)
    clock.run("dp", lambda: FakeWork(Clock(), 0.0)).wait()  # the post and the wait: two spans
    assert clock.seconds() == pytest.approx({"tp": 0.002, "dp": 0.004})


def direct_calls(source: str) -> list[int]:
    """The lines of `source` that call a communication function of torch.distributed (dist.x(...))."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "dist" and node.func.attr in COMMUNICATION]


def test_every_torch_distributed_call_goes_through_the_clock():
    """collectives.py hands torch.distributed's functions to Group._call (which the clock times) and
    calls none of them itself; no other module calls any."""
    direct = {str(p.relative_to(ROOT)): direct_calls(p.read_text()) for p in sorted((ROOT / "minipar").rglob("*.py"))}
    assert {path: lines for path, lines in direct.items() if lines} == {}
    # the check could not fail otherwise: it finds a direct call, and not a function handed over
    assert direct_calls("dist.all_reduce(t, group=g.pg)\ng._call(dist.send, t, dst=1)") == [1]


COMMUNICATION = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                 "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier", "send",
                 "recv", "isend", "irecv", "batch_isend_irecv", "gather_object", "all_gather_object",
                 "broadcast_object_list", "scatter_object_list", "monitored_barrier"}
