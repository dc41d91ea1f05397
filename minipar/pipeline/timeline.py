"""A pipeline's timeline: when each action ran on each rank, simulated on a clock or measured.

Chapter 6. `simulate(schedule)` runs a schedule's actions with fixed durations and no processes:
each rank takes its next action once the actions it needs (schedules.inputs_of) are done, so a
deadlock shows as a rank waiting forever, and the idle fraction is the schedule's bubble. A
`Timeline` holds such a simulated run or a measured one (Pipeline.run stamps each action), so the
two print and draw side by side. F forward, B backward (input gradient when split), W weight
gradient; "F3a" is F3 on a rank's first chunk.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import median

from minipar.pipeline.schedules import Action, Schedule, ScheduleError, inputs_of


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

    def costs(self) -> dict[tuple[str, int], float]:
        """The median duration of each (kind, stage)'s actions: a measured run's own costs, so that
        `simulate(schedule, timeline.costs())` replays its schedule on them with no wire and no overhead."""
        spans = defaultdict(list)
        for row in self.rows:
            for start, end, a in row:
                spans[a.kind, a.stage].append(end - start)
        return {key: median(v) for key, v in spans.items()}

    def _virtual(self) -> bool:
        return any(a.stage >= len(self.rows) for row in self.rows for _, _, a in row)

    def label(self, a: Action) -> str:
        """'F3', or with virtual stages 'F3a' / 'F3b': micro-batch 3 on the rank's first / second chunk."""
        return f"{a}{'abcdefgh'[a.stage // len(self.rows)]}" if self._virtual() else str(a)

    def ascii(self, unit: float = 1.0) -> str:
        """One line per rank, one cell per time unit, named by `label` ("." idle)."""
        width = 4 if self._virtual() else 3
        t0 = min(s for row in self.rows for s, _, _ in row)
        cells_per_rank = round(self.makespan / unit)
        lines = []
        for r, row in enumerate(self.rows):
            cells = [".".rjust(width)] * cells_per_rank
            for start, end, a in row:
                first = min(round((start - t0) / unit), cells_per_rank - 1)
                last = max(round((end - t0) / unit), first + 1)  # an action shorter than a cell keeps one
                for k in range(first, min(last, cells_per_rank)):
                    cells[k] = self.label(a).rjust(width)
            lines.append(f"rank {r}: " + "".join(cells))
        return "\n".join(lines)

    def draw(self, path: str, title: str = "") -> None:
        """Save the timeline as a PNG: one row per rank, F blue, B orange, W green, gaps = bubble."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        colours = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
        t0 = min(s for row in self.rows for s, _, _ in row)
        unit = min(end - start for row in self.rows for start, end, _ in row) or 1.0  # measured runs: tiny actions
        width = min(40.0, max(6.0, self.makespan / unit * 0.35))
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


def simulate(schedule: Schedule, durations: dict | None = None) -> Timeline:
    """Run the schedule with fixed action times (default F=1, B=2, or B=1 and W=1 when split),
    given by kind ("F") or, for stages of unequal cost, by kind and stage (("F", 3): Timeline.costs).
    Ranks still waiting when no rank can go on are deadlocked: ScheduleError names where."""
    split = any(a.kind == "W" for acts in schedule.actions for a in acts)
    durations = durations or ({"F": 1.0, "B": 1.0, "W": 1.0} if split else {"F": 1.0, "B": 2.0})
    actions, n = schedule.actions, schedule.n_stages
    done: dict[Action, float] = {}  # action -> when it finished
    waiting: dict[Action, list[int]] = {}  # action not done yet -> the ranks whose next action needs it
    rows: list[list] = [[] for _ in actions]
    next_of, free_at, runnable = [0] * len(actions), [0.0] * len(actions), list(range(len(actions)))
    while runnable:
        r = runnable.pop()
        while next_of[r] < len(actions[r]):
            a = actions[r][next_of[r]]
            needs = inputs_of(a, n)
            finished = [done.get(x) for x in needs]
            if None in finished:
                waiting.setdefault(needs[finished.index(None)], []).append(r)
                break
            start = max([free_at[r], *finished])
            cost = durations[a.kind, a.stage] if (a.kind, a.stage) in durations else durations[a.kind]
            done[a] = free_at[r] = start + cost
            rows[r].append((start, done[a], a))
            next_of[r] += 1
            runnable += waiting.pop(a, [])
    stuck = {r: str(acts[next_of[r]]) for r, acts in enumerate(actions) if next_of[r] < len(acts)}
    if stuck:
        raise ScheduleError(f"deadlock: ranks wait forever at {stuck}")
    return Timeline(rows)
