"""Where the profiled steps' time went, per rank: the traces of train.py --profile-steps, read.

    .venv/bin/python scripts/tools/trace_report.py runs/run_001/traces/steps_5-6

Each rank's trace (minipar/run/profiling.py) holds its steps (ProfilerStep#N), its operators, and
every message as a range the clock named (minipar/comm_clock.py): a blocking call, or a posted
message ('posted #k') and its handle's wait ('wait #k'). On the thread that runs the steps:

    communication   time inside those ranges: the rank waits (comm exposed, as the log counts it)
    compute         time in an operator outside them
    idle            the rest of the step: Python, the loop, the profiler; no operator runs
    overlapped      of the time a message is outstanding (in a call, or posted and not yet waited
                    for: in flight), the share the rank computes meanwhile: communication hidden

Holistic Trace Analysis computes the overlap and an idle breakdown from GPU kernels only; on a CPU
trace, which has none, it returns NaN or raises (docs/10_operating.md#profiling), so this script
computes both from the host's ranges. (On a GPU the host waits for little, NCCL's kernels do: read
HTA there.) A bad folder or file is one line and exit code 2 (minipar/ops/args.py).
"""

import json
import math
import re
import sys
from bisect import bisect_right
from pathlib import Path

from minipar.ops.args import HelpFormatter, Parser, existing_folder, refusals
from minipar.run.paths import InputError, regular_file

MAX_BYTES = 2**31  # a few steps' trace is megabytes; json.loads holds several times the file in memory
POSTED = re.compile(r"minipar .*, (posted|wait) #(\d+)$")  # a posted message and its wait share the number
STEP = re.compile(r"ProfilerStep#(\d+)")


def parse_args(argv=None):
    p = Parser(prog="trace_report.py", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("folder", type=existing_folder, help="a folder of rank*.pt.trace.json: <out>/traces/steps_A-B")
    return p.parse_args(argv)


def merged(spans) -> list[tuple[float, float]]:
    """The union of (start, end) spans, as sorted spans that do not touch."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def inside(spans: list[tuple[float, float]], t: float) -> bool:
    i = bisect_right(spans, (t, math.inf)) - 1
    return i >= 0 and spans[i][0] <= t < spans[i][1]


def load(path: Path) -> tuple[list[dict], int]:
    """A trace's complete events ("ph": "X") and the run's world size (torch.profiler writes it in
    distributedInfo; 1 without a process group), or one line saying why the file is not a trace: too
    large to read, nested deeper than Python's parser recurses (a trace is a few levels deep), not
    JSON or not a trace's shape, or a time that is no number (NaN, 1e999: a report of nonsense)."""
    size = regular_file(path).stat().st_size  # regular: a FIFO would block
    if size > MAX_BYTES:
        raise InputError(f"{path} is {size:,} bytes, more than a trace of a few steps ({MAX_BYTES:,}): profile "
                         f"fewer steps")
    try:
        trace = json.loads(path.read_text())
        world, events = trace.get("distributedInfo", {}).get("world_size", 1), trace["traceEvents"]
        events = [e for e in events if e.get("ph") == "X" and isinstance(e.get("name"), str)
                  and all(isinstance(e.get(k), (int, float)) for k in ("ts", "dur"))]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # not JSON, or not a trace's shape
        raise InputError(f"{path} is not a Chrome trace of torch.profiler ({type(e).__name__}: {e}): give a "
                         f"folder train.py --profile-steps wrote") from None
    bad = next((e for e in events if not (math.isfinite(e["ts"]) and 0 <= e["dur"] < math.inf)), None)
    if bad is not None:
        raise InputError(f"{path}: {bad['name']!r} has ts {bad['ts']} and dur {bad['dur']}, not a time: it is not "
                         f"a trace torch.profiler wrote")
    if not isinstance(world, int) or world < 1:
        raise InputError(f"{path}: its world_size {world!r} is not a number of ranks: it is not a trace torch.profiler "
                         f"wrote")
    return events, world


def figures(path: Path) -> dict:
    """One rank's figures over its profiled steps, in microseconds and shares."""
    events, world = load(path)
    steps = sorted((e for e in events if STEP.fullmatch(e["name"])), key=lambda e: e["ts"])
    if not steps:
        raise InputError(f"{path} has no ProfilerStep# ranges: it is not a trace of train.py --profile-steps")
    thread = steps[0].get("tid")  # the training thread: its operators and messages
    mine = [(e, (e["ts"], e["ts"] + e["dur"])) for e in events if e.get("tid") == thread]
    comm = merged(span for e, span in mine if e["name"].startswith("minipar "))
    ops = merged(span for e, span in mine if e.get("cat") == "cpu_op")
    ends: dict[int, dict[str, float]] = {}  # message number -> {"posted": its post's start, "wait": its wait's end}
    for e, (start, end) in mine:
        if match := POSTED.match(e["name"]):
            ends.setdefault(int(match[2]), {})[match[1]] = start if match[1] == "posted" else end
    step_spans = merged((e["ts"], e["ts"] + e["dur"]) for e in steps)
    last = step_spans[-1][1]  # a message never waited for is in flight to the end
    flight = merged((m["posted"], m.get("wait", last)) for m in ends.values() if "posted" in m)
    cuts = sorted({t for spans in (step_spans, comm, ops, flight) for span in spans for t in span})
    time = dict.fromkeys(("step", "communication", "compute", "idle", "outstanding", "overlapped"), 0.0)
    for a, b in zip(cuts, cuts[1:]):  # each piece between two boundaries is wholly in or out of each set
        t = (a + b) / 2
        if not inside(step_spans, t):
            continue
        kind = "communication" if inside(comm, t) else "compute" if inside(ops, t) else "idle"
        time["step"] += b - a
        time[kind] += b - a
        time["outstanding"] += (b - a) * (kind == "communication" or inside(flight, t))
        time["overlapped"] += (b - a) * (kind == "compute" and inside(flight, t))
    return time | {"steps": [int(STEP.fullmatch(e["name"])[1]) for e in steps], "world": world}


def share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def rank_of(path: Path) -> int:
    match = re.fullmatch(r"rank(\d+)\.pt\.trace\.json", path.name)
    return int(match[1]) if match else -1


def main(argv=None) -> dict[int, dict]:
    with refusals():  # a missing folder, one without traces, a file that is not one: one line
        folder = parse_args(argv).folder
        paths = sorted((p for p in folder.iterdir() if rank_of(p) >= 0), key=rank_of)
        if not paths:
            raise InputError(f"{folder} holds no rank*.pt.trace.json: give a folder train.py --profile-steps "
                             f"wrote, <out>/traces/steps_A-B")
        report = {rank_of(p): figures(p) for p in paths}
    steps, world = report[rank_of(paths[0])]["steps"], max(t["world"] for t in report.values())
    missing = sorted(set(range(world)) - set(report))
    if missing:  # a report of some ranks reads like one of all: say so (an older run's ranks each chose a folder)
        print(f"trace_report.py: warning: the run had {world} ranks and {folder} holds the traces of {len(report)}: "
              f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} missing; the figures below are only "
              f"those of the ranks here", file=sys.stderr)
    print(f"{folder}: {len(paths)} rank(s), steps {steps[0]} to {steps[-1]}; each rank's training thread, host time")
    print(f"{'rank':>4} {'step ms':>9} {'compute':>8} {'comm':>6} {'idle':>6}   {'outstanding ms':>14} "
          f"{'overlapped':>10}")
    for rank, t in report.items():
        t["shares"] = {k: share(t[k], t["step"]) for k in ("compute", "communication", "idle")}
        t["overlap"] = share(t["overlapped"], t["outstanding"])
        print(f"{rank:>4} {t['step'] / 1e3:>9.1f} {t['shares']['compute']:>8.0%} {t['shares']['communication']:>6.0%}"
              f" {t['shares']['idle']:>6.0%}   {t['outstanding'] / 1e3:>14.1f} {t['overlap']:>10.0%}")
    print("compute, comm (exposed), idle: shares of the step; overlapped: of the time a message was outstanding, "
          "the share the rank computed (hidden communication)")
    return report


if __name__ == "__main__":
    main()
