"""A pipeline's timeline: when each action ran on each rank, as text and as a picture.

Chapter 4. One object holds a simulated run (pipeline_schedules.simulate) and a measured one
(Pipeline.run stamps each action), so the two print and draw side by side. F forward, B backward
(input gradient when split), W weight gradient; "F3a" is F3 on a rank's first chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # actions are defined with the schedules, which use this file
    from minipar.pipeline.schedules import Action


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
