"""Exercise 6.1, wrong: the backwards in reverse micro-batch order (last in, first out): it runs, but
it is not GPipe as the chapter builds it (and the first backward waits for the last forward)."""

from minipar.pipeline.schedules import Action


def gpipe(p, m):
    return [[Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in reversed(range(m))] for s in range(p)]
