"""Exercise 6.1, wrong (issue 40's walk-around): the library's 1F1B (a sibling), its actions sorted
into GPipe's order: every forward, then every backward."""

from minipar.pipeline.schedules import one_f_one_b


def gpipe(p, m):
    return [sorted(actions, key=lambda a: (a.kind != "F", a.microbatch)) for actions in
            one_f_one_b(p, m)]
