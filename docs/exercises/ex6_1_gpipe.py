"""Exercise 6.1 (chapter 6): GPipe's list of actions.

A pipeline schedule is, for each of p ranks (rank s holds stage s), the ordered list of what it
computes: `Action("F", i, s)` the forward of micro-batch i on stage s, `Action("B", i, s)` its
backward. GPipe: every rank runs the forwards of all m micro-batches, then all their backwards,
each in micro-batch order. Stage s can only run F(i) after stage s-1 did, and B(i) after stage s+1
did; the checker simulates your schedule (minipar.pipeline.timeline.simulate) to see that it
finishes, with GPipe's bubble.

The library's `gpipe` (and so `build("gpipe", ...)`) is switched off while the checker runs.

The library's own, after you tried: `gpipe` in minipar/pipeline/schedules.py.

Check: make exercise N=6.1 (no ranks needed, a second)
"""

from minipar.pipeline.schedules import Action  # noqa: F401 - yours to use


def gpipe(p: int, m: int) -> list[list[Action]]:
    """actions[s]: what rank s runs, in order, for p stages and m micro-batches."""
    raise NotImplementedError("hint: one list per stage s: the m forwards, then the m backwards")
