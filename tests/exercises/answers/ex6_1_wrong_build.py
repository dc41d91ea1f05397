"""Exercise 6.1, wrong: the library's schedule builder asked for GPipe by name: it calls the library's
gpipe, which the checker switches off."""

from minipar.pipeline.schedules import build


def gpipe(p, m):
    return build("gpipe", p, m).actions
