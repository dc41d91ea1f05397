"""Exercise 9.3, wrong (issue 40's walk-around): minipar.mesh.MeshLayout asked, a function of the variant, not a
prediction. A prediction is a value written out; code that computes it is refused."""

from minipar.mesh import MeshLayout


def ANSWER(v):  # noqa: N802
    layout = MeshLayout(world_size=32, **v.mesh, ranks_per_node=v.ranks_per_node)
    return [d for d in ("tp", "cp", "dp", "pp") if any(len({layout.node(r) for r in g}) > 1 for g in layout.groups(d))]
