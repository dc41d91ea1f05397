"""Exercise 6.1, an answer: on every rank the m forwards of its stage, then the m backwards, each in
micro-batch order."""

from minipar.pipeline.schedules import Action


def gpipe(p, m):
    return [[Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)] for s in range(p)]
