"""The mesh: every rank's place in the 4D grid, and one process group per line of it.

Chapters 1 and 10 (the appendix) of the course. The world of dp*tp*pp*cp ranks is a grid of
shape (pp, dp, cp, tp), numbered with tp fastest, so that the chattiest groups (tp, then cp)
get neighbouring ranks, which torchrun puts on one node:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

    world 8 = pp2 x dp2 x cp1 x tp2        tp groups: {0,1} {2,3} {4,5} {6,7}
       pp0: dp0 [0 1]   dp1 [2 3]          dp groups: {0,2} {1,3} {4,6} {5,7}
       pp1: dp0 [4 5]   dp1 [6 7]          pp groups: {0,4} {1,5} {2,6} {3,7}

A group is a line through the grid (every coordinate shared but one); the dp x cp groups average
the replicated gradients (chapter 5), and `Mesh.unflatten` carves experts' edp x ep out of them
(chapter 7). With K ranks per node, global rank r lives on node r // K. `MeshLayout` is the pure
arithmetic; `Mesh` adds this rank's process groups and hands them out by name (`Groups`). There
is no global mesh. Read docs/10_operating.md (section 2) and docs/09_4d.md.
"""

from __future__ import annotations

import datetime
import itertools
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from minipar.collectives import Group, Ledger
from minipar.placement import Placement

# Outermost first. The last dimension varies fastest in rank numbering.
DIMS = ("pp", "dp", "cp", "tp")


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message says what to change."""


def check_counts(**counts: int | None) -> None:
    """Each degree (and --ranks-per-node, given) a count of 1 or more, before anything divides by it."""
    for name, n in counts.items():
        if n is not None and n < 1:
            raise LayoutError(f"--{name.replace('_', '-')} {n}: give 1 or more")


@dataclass(frozen=True)
class MeshLayout:
    world_size: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ranks_per_node: int | None = None  # None: every rank on one node

    def __post_init__(self):
        check_counts(**{dim: getattr(self, dim) for dim in DIMS}, ranks_per_node=self.ranks_per_node)
        k = self.ranks_per_node
        if k is not None and self.world_size % k:
            raise LayoutError(f"--ranks-per-node {k} does not divide the world's {self.world_size} ranks: give a "
                              f"divisor of {self.world_size} (the ranks torchrun starts on each node)")
        product = self.dp * self.tp * self.pp * self.cp
        if product != self.world_size:
            raise LayoutError(f"--dp {self.dp} x --tp {self.tp} x --pp {self.pp} x --cp {self.cp} = {product} ranks, "
                              f"but the world has {self.world_size}: launch with torchrun --nproc-per-node "
                              f"{product} or change the degrees so that their product is {self.world_size}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)  # (pp, dp, cp, tp)

    @property
    def nodes(self) -> int:
        return self.world_size // (self.ranks_per_node or self.world_size)

    def node(self, rank: int) -> int:
        """The node global rank `rank` lives on (torchrun numbers each node's ranks consecutively)."""
        return rank // (self.ranks_per_node or self.world_size)

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> {"pp": i, "dp": j, "cp": k, "tp": l}."""
        return {d: int(c) for d, c in zip(DIMS, torch.unravel_index(torch.tensor(rank), self.shape))}

    def rank(self, **coords: int) -> int:
        """{"pp": i, ...} -> rank; missing coordinates count as 0."""
        r = 0
        for dim, size in zip(DIMS, self.shape):
            c = coords.get(dim, 0)
            if not 0 <= c < size:
                raise IndexError(f"{dim} coordinate {c} outside 0..{size - 1}")
            r = r * size + c
        return r

    def grid(self) -> torch.Tensor:
        """Every rank at its place in the grid: grid[pp, dp, cp, tp] = rank."""
        return torch.arange(self.world_size).view(self.shape)

    def groups(self, *dims: str) -> list[list[int]]:
        """All groups that vary along `dims` (e.g. "tp", or "dp", "cp"), each a sorted rank list: the
        grid's lines along them. Ranks that agree on every other coordinate form one group; the groups
        partition the world."""
        return lines_along(self.grid(), [DIMS.index(d) for d in dims])

    def unflatten_groups(self, dims: tuple[str, ...], sizes: dict[str, int]) -> dict[str, list[list[int]]]:
        """Each group along `dims` reshaped to `sizes` (last fastest): {new dim: its groups}."""
        product, span = math.prod(sizes.values()), len(self.groups(*dims)[0])
        if product != span:
            raise LayoutError(f"{' x '.join(f'{k} {v}' for k, v in sizes.items())} = {product}, but the "
                              f"{' x '.join(dims)} groups have {span} ranks: choose sizes whose product is {span}")
        out: dict[str, list[list[int]]] = {name: [] for name in sizes}
        for members in self.groups(*dims):
            for i, name in enumerate(sizes):  # a group: the members that differ only along `name`
                out[name] += lines_along(torch.tensor(members).view(*sizes.values()), [i])
        return out

    def table(self) -> str:
        """The grid as text: one line per (pp, dp), the tp ranks of each cp slot side by side."""
        lines = [f"mesh pp{self.pp} x dp{self.dp} x cp{self.cp} x tp{self.tp} = {self.world_size} ranks"]
        if self.nodes > 1:
            lines[0] += f" on {self.nodes} nodes of {self.ranks_per_node}"
        grid = self.grid().tolist()
        for p, d in itertools.product(range(self.pp), range(self.dp)):
            cells = (f"cp{c}:[{' '.join(f'{r:>2}' for r in ranks)}]" for c, ranks in enumerate(grid[p][d]))
            lines.append(f"  pp{p} dp{d}  " + "  ".join(cells))
        return "\n".join(lines)


def lines_along(grid: torch.Tensor, axes: list[int]) -> list[list[int]]:
    """The lines of `grid` along `axes`: its entries that differ only in those coordinates, each sorted."""
    span = math.prod(grid.shape[a] for a in axes)
    moved = grid.movedim(axes, list(range(grid.dim() - len(axes), grid.dim())))  # `axes` last, in their order
    return [sorted(line) for line in moved.reshape(-1, span).tolist()]


def _solo(name: str):
    return field(default_factory=lambda: Group.solo(name))


@dataclass(frozen=True)
class Groups:
    """The groups a module needs, by name: what the mesh hands out (`mesh.groups()`) and what the
    gradient-sync wrappers, checkpoints and tensor-parallel helpers take. A dimension the layout
    lacks is a group of one, whose collectives cost nothing. Tests make one from the groups they
    have: `Groups(dp=group)` averages every gradient over that one group."""

    dp: Group = _solo("dp")
    tp: Group = _solo("tp")
    pp: Group = _solo("pp")
    cp: Group = _solo("cp")
    dp_cp: Group = _solo("dp_cp")  # dense gradients are averaged over data *and* context replicas
    ep: Group = _solo("ep")  # experts: carved out of dp x cp by Mesh.unflatten
    edp: Group = _solo("edp")
    more: dict[str, Group] = field(default_factory=dict)  # what Mesh.unflatten carved out for a feature

    NAMES: ClassVar = ("dp", "tp", "pp", "cp", "dp_cp", "ep", "edp")

    def __getitem__(self, name: str) -> Group:
        if name not in self.NAMES and name not in self.more:
            raise KeyError(f"no {name} group: the groups are {', '.join((*self.NAMES, *self.more))}")
        return getattr(self, name) if name in self.NAMES else self.more[name]

    def reduction(self, dims: tuple[str, ...]) -> Group:
        """Where a gradient averaged over `dims` (its Placement.grad_mean) is reduced: ("dp", "cp")
        is the dp x cp group, or the dp group alone when cp is 1; ("edp",) the expert replicas."""
        if all(self[d].size == 1 for d in dims[1:]):
            return self[dims[0]]
        return self["_".join(dims)]

    def shards(self, placement: Placement) -> tuple[Group, ...]:
        """The groups whose ranks hold the other pieces of a parameter (its Placement.shards: tp, ep)."""
        return tuple(self[d] for d, _ in placement.shards)


# The groups every rank builds, by name -> the dimensions they vary along.
# pp_grad: the pipeline's ranks again, a second channel so activations and gradients never share one.
GROUP_DIMS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "pp_grad": ("pp",), "dp_cp": ("dp", "cp")}


@dataclass
class Mesh:
    """This rank's view of the layout, with a process group for each of its lines. Every rank must
    construct the Mesh at the same time: creating a process group is a collective over the world."""

    layout: MeshLayout
    rank: int
    ledger: Ledger = field(default_factory=Ledger)
    _groups: dict[str, Group] = field(default_factory=dict)

    @classmethod
    def build(cls, dp=1, tp=1, pp=1, cp=1, ledger: Ledger | None = None, timeout: float | None = None,
              ranks_per_node: int | None = None) -> Mesh:
        """timeout: seconds an operation of these groups may wait before it fails (None: torch's).
        ranks_per_node: how many consecutive ranks share a node (None: all of them, one node)."""
        layout = MeshLayout(dist.get_world_size(), dp=dp, tp=tp, pp=pp, cp=cp, ranks_per_node=ranks_per_node)
        mesh = cls(layout, dist.get_rank(), ledger or Ledger())
        limit = None if timeout is None else datetime.timedelta(seconds=timeout)
        for name, dims in GROUP_DIMS.items():
            for ranks in layout.groups(*dims):  # every rank creates every group, in one order
                # The pipeline's gradient channel is always a communicator of its own, even when
                # its ranks are the whole world (pipeline/executor.py says why).
                own = len(ranks) < layout.world_size or name == "pp_grad"
                pg = dist.new_group(ranks, timeout=limit) if own else dist.group.WORLD
                if mesh.rank in ranks:
                    mesh._groups[name] = Group(name, pg, ranks, mesh.ledger, layout.ranks_per_node)
        return mesh

    # -- groups and coordinates ----------------------------------------------------------------
    def group(self, *dims: str, channel: str = "") -> Group:
        """This rank's group along `dims`: mesh.group("tp"), mesh.group("dp", "cp"); a dimension made
        by `unflatten` too. channel="grad": the pipeline's second communicator over the pp ranks."""
        name = "_".join(dims) + (f"_{channel}" if channel else "")
        if name not in self._groups:
            raise KeyError(f"no {name} group in this mesh: it has {', '.join(self._groups)}")
        return self._groups[name]

    def coord(self, dim: str) -> int:
        """This rank's coordinate along `dim` (its rank inside the group of that dimension)."""
        return self.coords[dim] if dim in DIMS else self.group(dim).rank

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    @property
    def node(self) -> int:
        """The node this rank lives on."""
        return self.layout.node(self.rank)

    def groups(self) -> Groups:
        """The groups a module needs, by name, in one typed object (ep and edp once `unflatten`
        has carved them out, else groups of one)."""
        return Groups(**{name: self._groups[name] for name in Groups.NAMES if name in self._groups},
                      more={name: g for name, g in self._groups.items() if name not in Groups.NAMES})

    def unflatten(self, dims: tuple[str, ...], **sizes: int) -> None:
        """Carve new named dimensions out of a product of existing ones: the group along `dims`
        is reshaped to `sizes` (in order, the last varying fastest), and a group is built for each
        new dimension. Expert parallelism does mesh.unflatten(("dp", "cp"), edp=2, ep=4).
        Every rank must call it at the same time (creating groups is a collective)."""
        for name, groups in self.layout.unflatten_groups(dims, sizes).items():
            for ranks in groups:
                pg = dist.new_group(ranks) if len(ranks) < self.layout.world_size else dist.group.WORLD
                if self.rank in ranks:
                    self._groups[name] = Group(name, pg, ranks, self.ledger, self.layout.ranks_per_node)

    def destroy(self) -> None:
        """Free this mesh's process groups (tests build many meshes in one world)."""
        for pg in {id(g.pg): g.pg for g in self._groups.values() if g.pg is not dist.group.WORLD}.values():
            dist.destroy_process_group(pg)
        self._groups.clear()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()
