"""Pipeline schedules as data: for each rank, the ordered list of what it computes.

Chapter 4 of the course, first half. Cut the model's layers into p stages, one per rank, and the
batch into m micro-batches. Stage s can run the forward of micro-batch i only after stage s-1 has,
and the backward only after stage s+1 has. A *schedule* is the order in which each rank takes its
actions:

    F(i)  forward of micro-batch i        B(i)  backward of micro-batch i (input gradient;
    W(i)  weight gradient of i                  with no W in the schedule, B does both)

Nothing here runs a model. A schedule is a list of actions per rank, so it can be printed, drawn,
simulated with unit-time actions and tested without starting any process; `pipeline.py` has the
one executor that runs any of them. The schedules, p = 4 ranks, m = 8 micro-batches:

    naive        one micro-batch at a time: F0 on stage 0, then stage 1, ... the others wait
    gpipe        all forwards, then all backwards (bubble (p-1)/(m+p-1), m activations held)
    1f1b         after p-s-1 warm-up forwards, alternate one forward and one backward: the same
                 bubble, but stage s holds at most p-s micro-batches of activations
    interleaved  each rank holds v chunks of layers (virtual stages s, s+p, s+2p, ...): the fill
                 and drain take 1/v as long, so the bubble shrinks about v times
    zb1          zero-bubble ZB-H1: backward split into B (input gradient: the next stage waits
                 for it) and W (weight gradient: nobody waits); W's fill the bubbles, with no
                 stage holding more activations than 1F1B's first stage (p micro-batches)

An action carries its virtual stage `stage` (for non-interleaved schedules, the rank). With v
chunks per rank, virtual stage k lives on rank k % p as chunk k // p.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb1")


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    microbatch: int
    stage: int  # virtual stage (equals the rank unless interleaved)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


class ScheduleError(ValueError):
    """A schedule that cannot be built for these sizes; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# The schedules
# ----------------------------------------------------------------------------------------------


def naive(p: int, m: int) -> list[list[Action]]:
    """Model parallelism with no pipelining: the whole batch as one micro-batch."""
    if m != 1:
        raise ScheduleError(f"the naive schedule runs one micro-batch, got {m}: use gpipe or 1f1b for more")
    return gpipe(p, 1)


def gpipe(p: int, m: int) -> list[list[Action]]:
    return [[Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)] for s in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [Action("F", i, s) for i in range(warmup)]
        for i in range(warmup, m):  # steady state: one forward, then the oldest backward
            acts += [Action("F", i, s), Action("B", i - warmup, s)]
        acts += [Action("B", i, s) for i in range(m - warmup, m)]
        out.append(acts)
    return out


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: v chunks per rank, micro-batches in groups of p."""
    if v < 2:
        raise ScheduleError("the interleaved schedule needs --virtual-stages of at least 2")
    if m % p:
        raise ScheduleError(f"the interleaved schedule needs micro-batches ({m}) divisible by pp ({p})")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        # The k-th forward (or backward) of a rank: which micro-batch, and which chunk.
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, chunk if forward else v - 1 - chunk

    out = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        acts = []
        f = b = 0
        for _ in range(warmup):
            i, c = unit(f, True)
            acts.append(Action("F", i, c * p + s))
            f += 1
        while b < total:
            if f < total:
                i, c = unit(f, True)
                acts.append(Action("F", i, c * p + s))
                f += 1
            i, c = unit(b, False)
            acts.append(Action("B", i, c * p + s))
            b += 1
        out.append(acts)
    return out


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order of F and B, with each W placed where its stage would otherwise wait.

    Built by simulating unit-time actions: a rank runs its next F or B when its inputs have
    arrived; when it would idle, it runs the oldest pending W instead. Activations are freed by W,
    and a rank holds at most p micro-batches between F and W: the peak of 1F1B (its first stage),
    now on every stage. With F = B = W the idle fraction is then (p-1) / (3m + p-1), the paper's.
    """
    plan = [[a for a in acts] for acts in one_f_one_b(p, m)]
    done: dict[Action, int] = {}
    out: list[list[Action]] = [[] for _ in range(p)]
    pending_w: list[list[int]] = [[] for _ in range(p)]
    t = 0
    while any(plan) or any(pending_w):
        finished_now = {}
        for s in range(p):
            nxt = plan[s][0] if plan[s] else None
            in_flight = sum(1 for a in out[s] if a.kind == "F") - sum(1 for a in out[s] if a.kind == "W")
            ready = nxt is not None and _deps_done(nxt, p, done, t, split=True)
            if nxt is not None and nxt.kind == "F" and in_flight >= p:
                ready = False  # memory cap: retire a W first
            if ready:
                act = plan[s].pop(0)
                if act.kind == "B":
                    pending_w[s].append(act.microbatch)
            elif pending_w[s]:
                act = Action("W", pending_w[s].pop(0), s)
            else:
                continue
            out[s].append(act)
            finished_now[act] = t + 1
        done.update(finished_now)
        t += 1
        if t > 10 * (m + p) * 3:
            raise ScheduleError("zb1 schedule construction did not finish")  # cannot happen; a guard
    return out


def build(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each rank's action list for schedule `name` on p stages and m micro-batches."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule '{name}': choose one of {', '.join(SCHEDULES)}")
    if m < 1 or p < 1:
        raise ScheduleError("pp and the number of micro-batches must be at least 1")
    if name != "interleaved" and v != 1:
        raise ScheduleError("--virtual-stages above 1 needs --schedule interleaved")
    if name == "naive":
        return naive(p, m)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved(p, m, v)
    return zero_bubble_h1(p, m)


def messages(schedule: list[list[Action]]) -> list[list[tuple]]:
    """The point-to-point operations each rank posts when it runs its actions, in order, as
    order_check traces: (channel, "send" or "recv", peer rank, micro-batch). The channel is the
    activations' or the gradients' (pipeline.py sends them on two process groups), and the
    micro-batch stands in for the message size, so that a receive matched with the wrong message
    is caught even when the sizes agree. Virtual stage k lives on rank k % p."""
    p = len(schedule)
    n_stages = 1 + max(a.stage for acts in schedule for a in acts)
    ranks = tuple(range(p))
    act, grad = ("pp", ranks), ("pp_grad", ranks)
    traces = []
    for acts in schedule:
        trace = []
        for a in acts:
            i, k = a.microbatch, a.stage
            if a.kind == "F":
                trace += [(act, "recv", (k - 1) % p, i)] if k > 0 else []
                trace += [(act, "send", (k + 1) % p, i)] if k < n_stages - 1 else []
            elif a.kind == "B":
                trace += [(grad, "recv", (k + 1) % p, i)] if k < n_stages - 1 else []
                trace += [(grad, "send", (k - 1) % p, i)] if k > 0 else []
        traces.append(trace)
    return traces


# ----------------------------------------------------------------------------------------------
# Simulation: unit-time actions, to find deadlocks, bubbles and memory without any process
# ----------------------------------------------------------------------------------------------


def _deps_done(a: Action, n_stages: int, done: dict, t: int, split: bool) -> bool:
    """Are the inputs of action `a` available at time t? (n_stages: virtual stages in total.)"""
    def ok(x: Action) -> bool:
        return x in done and done[x] <= t

    if a.kind == "F":
        return a.stage == 0 or ok(Action("F", a.microbatch, a.stage - 1))
    if a.kind == "B":
        after = Action("B", a.microbatch, a.stage + 1) if a.stage < n_stages - 1 else None
        return ok(Action("F", a.microbatch, a.stage)) and (after is None or ok(after))
    return ok(Action("B", a.microbatch, a.stage))  # W


@dataclass
class Timeline:
    """When each action ran: rows[rank] = [(start, end, action)], from a simulation or a real run."""

    rows: list[list[tuple[float, float, Action]]]

    @property
    def makespan(self) -> float:
        return max(end for row in self.rows for _, end, _ in row) - min(s for row in self.rows for s, _, _ in row)

    def idle_fraction(self) -> float:
        busy = sum(end - start for row in self.rows for start, end, _ in row)
        return 1.0 - busy / (len(self.rows) * self.makespan)

    def _virtual(self) -> bool:
        return any(a.stage >= len(self.rows) for row in self.rows for _, _, a in row)

    def label(self, a: Action) -> str:
        """'F3', or with virtual stages 'F3a' / 'F3b': micro-batch 3 on the rank's first / second chunk."""
        return f"{a}{'abcdefgh'[a.stage // len(self.rows)]}" if self._virtual() else str(a)

    def ascii(self, unit: float = 1.0) -> str:
        """One line per rank, one cell per time unit: "F3" forward of micro-batch 3, "." idle.

        With virtual stages the cell names the chunk too: "F3a" on a rank's first chunk, "F3b" its second.
        """
        width = 4 if self._virtual() else 3
        label = self.label
        t0 = min(s for row in self.rows for s, _, _ in row)
        cells_per_rank = round(self.makespan / unit)
        lines = []
        for r, row in enumerate(self.rows):
            cells = [".".rjust(width)] * cells_per_rank
            for start, end, a in row:
                first = min(round((start - t0) / unit), cells_per_rank - 1)
                last = max(round((end - t0) / unit), first + 1)  # an action shorter than a cell keeps one
                for k in range(first, min(last, cells_per_rank)):
                    cells[k] = label(a).rjust(width)
            lines.append(f"rank {r}: " + "".join(cells))
        return "\n".join(lines)


    def draw(self, path: str, title: str = "") -> None:
        """Save the timeline as a PNG: one row per rank, F blue, B orange, W green, gaps = bubble."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colours = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
        t0 = min(s for row in self.rows for s, _, _ in row)
        width = min(40.0, max(6.0, self.makespan / self._unit() * 0.35))  # measured runs have tiny actions
        fig, ax = plt.subplots(figsize=(width, 0.6 * len(self.rows) + 1))
        for r, row in enumerate(self.rows):
            for start, end, a in row:
                ax.barh(r, end - start, left=start - t0, color=colours[a.kind], edgecolor="white")
                ax.text((start + end) / 2 - t0, r, self.label(a), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(self.rows)), [f"rank {r}" for r in range(len(self.rows))])
        ax.invert_yaxis()
        ax.set_xlabel("time")
        ax.set_title(title or f"idle fraction {self.idle_fraction():.1%}")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def _unit(self) -> float:
        return min(end - start for row in self.rows for start, end, _ in row) or 1.0


def simulate(schedule: list[list[Action]], durations: dict[str, float] | None = None) -> Timeline:
    """Run the schedule with fixed action times (default F=1, B=2, or B=1 and W=1 when split).

    Raises ScheduleError if the ranks deadlock (some rank waits for an action that never comes).
    """
    split = any(a.kind == "W" for acts in schedule for a in acts)
    durations = durations or ({"F": 1.0, "B": 1.0, "W": 1.0} if split else {"F": 1.0, "B": 2.0})
    n_stages = 1 + max(a.stage for acts in schedule for a in acts)
    queue = [list(acts) for acts in schedule]
    free_at = [0.0] * len(schedule)
    done: dict[Action, float] = {}
    rows: list[list] = [[] for _ in schedule]
    while any(queue):
        progressed = False
        for r, acts in enumerate(queue):
            while acts:
                a = acts[0]
                deps = _input_times(a, n_stages, done)
                if deps is None:
                    break
                start = max([free_at[r], *deps])
                end = start + durations[a.kind]
                done[a] = end
                free_at[r] = end
                rows[r].append((start, end, a))
                acts.pop(0)
                progressed = True
        if not progressed:
            stuck = {r: str(acts[0]) for r, acts in enumerate(queue) if acts}
            raise ScheduleError(f"deadlock: ranks wait forever at {stuck}")
    return Timeline(rows)


def _input_times(a: Action, n_stages: int, done: dict) -> list[float] | None:
    """Finish times of the actions `a` waits for, or None if one of them has not been placed yet."""
    if a.kind == "F":
        needs = [Action("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
    elif a.kind == "B":
        needs = [Action("F", a.microbatch, a.stage)]
        if a.stage < n_stages - 1:
            needs.append(Action("B", a.microbatch, a.stage + 1))
    else:
        needs = [Action("B", a.microbatch, a.stage)]
    if any(n not in done for n in needs):
        return None
    return [done[n] for n in needs]


def peak_activations(actions: list[Action]) -> int:
    """The most micro-batches whose activations a rank holds at once (F done, not yet released).

    Activations are released by B, or by W when the schedule splits the backward.
    """
    split = any(a.kind == "W" for a in actions)
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == ("W" if split else "B"):
            held -= 1
    return peak


def bubble_formula(p: int, m: int) -> float:
    """GPipe's and 1F1B's idle fraction: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)
