"""Exercise 9.1, the mesh's answer."""

from minipar.mesh import MeshLayout

_layout = MeshLayout(16, dp=2, tp=2, pp=2, cp=2)
ANSWER = {d: next(g for g in _layout.groups(d) if 5 in g) for d in ("tp", "cp", "dp", "pp")}
