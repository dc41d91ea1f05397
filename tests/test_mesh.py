"""The mesh: groups partition the world, coordinates round-trip, the groups a module needs come by name."""

import itertools
import os

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks, tiers

from minipar.collectives import Group, Ledger, all_reduce
from minipar.mesh import DIMS, GROUP_DIMS, Groups, LayoutError, Mesh, MeshLayout
from minipar.placement import Placement


def all_layouts(max_world=8):
    for world in range(1, max_world + 1):
        for pp, dp, cp, tp in itertools.product(range(1, world + 1), repeat=4):
            if pp * dp * cp * tp == world:
                yield MeshLayout(world, dp=dp, tp=tp, pp=pp, cp=cp)


LAYOUTS = list(all_layouts())


def test_every_layout_of_1_to_8_ranks_is_enumerated():
    # 1..8 ranks: the number of ordered factorisations into 4 factors, summed.
    assert len(LAYOUTS) == sum(
        sum(1 for f in itertools.product(range(1, w + 1), repeat=4) if f[0] * f[1] * f[2] * f[3] == w)
        for w in range(1, 9)
    )
    assert len(LAYOUTS) > 50


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"w{l.world_size}-pp{l.pp}dp{l.dp}cp{l.cp}tp{l.tp}")
def test_groups_partition_world_and_coords_round_trip(layout):
    world = set(range(layout.world_size))
    for rank in world:
        assert layout.rank(**layout.coords(rank)) == rank
    # Coordinates are all distinct and the numbering is tp-fastest.
    assert {tuple(layout.coords(r).values()) for r in world} == set(
        itertools.product(*(range(n) for n in layout.shape))
    )
    for r in range(layout.world_size - 1):
        if layout.tp > 1 and (r + 1) % layout.tp:
            assert layout.coords(r + 1)["tp"] == layout.coords(r)["tp"] + 1
    for dims in GROUP_DIMS.values():
        groups = layout.groups(*dims)
        size = 1
        for d in dims:
            size *= getattr(layout, d)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == sorted(world)  # a partition
        for g in groups:  # members differ only along dims
            for d in DIMS:
                if d not in dims:
                    assert len({layout.coords(r)[d] for r in g}) == 1


def test_bad_layouts_are_rejected_with_a_fix():
    with pytest.raises(LayoutError, match=r"= 8 ranks, but the world has 4: launch with torchrun --nproc-per-node 8"):
        MeshLayout(4, dp=2, tp=2, pp=2)
    with pytest.raises(LayoutError, match="--tp 0: give 1 or more"):
        MeshLayout(4, dp=4, tp=0)


def test_table_shows_every_rank_once():
    layout = MeshLayout(8, dp=2, tp=2, pp=2)
    text = layout.table()
    assert "pp2 x dp2 x cp1 x tp2" in text
    numbers = [int(t) for t in text.replace("[", " ").replace("]", " ").split() if t.isdigit()]
    assert sorted(numbers[-8:]) == list(range(8))


def _check_real_groups(rank, world, degrees):
    """Each real process group sums exactly the ranks the layout says it holds."""
    with Mesh.build(**degrees) as mesh:
        assert mesh.rank == rank
        for name, dims in GROUP_DIMS.items():
            group = mesh.group(*name.split("_")[:len(dims)], channel="grad" if name == "pp_grad" else "")
            if name != "pp_grad":  # the typed object hands out the same group
                assert group is mesh.groups()[name]
            assert group.ranks == next(g for g in mesh.layout.groups(*dims) if rank in g)
            t = torch.tensor([float(rank)])
            all_reduce(t, group)
            assert t.item() == sum(group.ranks), (name, group.ranks, t)
        # Activations and gradients of the pipeline never share a communicator.
        assert mesh.group("pp", channel="grad").pg is not mesh.groups().pp.pg
        groups = mesh.groups()  # the same groups, by name, in one typed object
        assert all(groups[name] is mesh.group(*name.split("_")) for name in ("dp", "tp", "pp", "cp", "dp_cp"))
        dense = groups.reduction(("dp", "cp"))  # dp x cp, or dp alone when cp is 1
        assert dense is (mesh.groups().dp_cp if mesh.layout.cp > 1 else mesh.groups().dp)
        assert groups.ep.size == groups.edp.size == 1  # no experts carved out: groups of one
        return dict(coords=mesh.coords)


@pytest.mark.parametrize(
    "degrees", tiers([dict(dp=2, tp=2, pp=2), dict(tp=2, cp=2, pp=2), dict(dp=2, cp=2, tp=2), dict(dp=8)], fast=0)
)
def test_real_process_groups_on_8_ranks(degrees):
    out = run_ranks(8, _check_real_groups, degrees)
    layout = MeshLayout(8, **degrees)
    for rank, r in enumerate(out):
        assert r["coords"] == layout.coords(rank)


def _mesh_with_wrong_world(rank, world):
    try:
        Mesh.build(dp=2, tp=2)
    except LayoutError as e:
        return str(e)


def test_mesh_build_rejects_mismatch_before_any_collective():
    msgs = run_ranks(2, _mesh_with_wrong_world)
    assert all("= 4 ranks, but the world has 2" in m for m in msgs)
    assert dist.is_available()


def test_mesh_has_no_hidden_accessors():
    assert "__getattr__" not in vars(Mesh)


def test_unflatten_reshapes_each_dp_cp_group_into_new_dimensions():
    layout = MeshLayout(8, dp=4, cp=2)  # one dp x cp group: ranks 0..7, cp fastest
    groups = layout.unflatten_groups(("dp", "cp"), dict(edp=2, ep=4))
    assert groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    two = MeshLayout(8, dp=2, tp=2, pp=2)  # four dp groups of two: ep 2 inside each, edp 1
    assert two.unflatten_groups(("dp",), dict(edp=1, ep=2))["ep"] == two.groups("dp")
    with pytest.raises(LayoutError, match="edp 3 x ep 2 = 6, but the dp x cp groups have 8 ranks"):
        layout.unflatten_groups(("dp", "cp"), dict(edp=3, ep=2))


def _unflattened(rank, world):
    with Mesh.build(dp=2, cp=2) as mesh:
        mesh.unflatten(("dp", "cp"), edp=2, ep=2)
        t = torch.tensor([float(rank)])
        all_reduce(t, mesh.group("ep"))
        groups = mesh.groups()
        assert groups.ep is mesh.group("ep") and groups.reduction(("edp",)) is mesh.group("edp")
        expert = Placement((8, 4), shards=(("ep", 0), ("tp", 1)))
        assert groups.shards(expert) == (groups.ep, groups.tp)
        return mesh.group("ep").ranks, mesh.group("edp").ranks, mesh.coord("ep"), t.item()


def test_unflatten_builds_real_groups():
    out = run_ranks(4, _unflattened)
    assert [o[0] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[1] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o[2] for o in out] == [0, 1, 0, 1] and [o[3] for o in out] == [1, 1, 5, 5]


def test_groups_made_of_one_group_average_every_gradient_over_it():
    dp = Group("dp", None, [0, 1], Ledger())
    groups = Groups(dp=dp)  # what a test with one plain group builds
    assert groups.reduction(("dp", "cp")) is dp  # cp is a group of one here
    assert groups.tp.size == groups.cp.size == groups.pp.size == 1
    with pytest.raises(KeyError, match="no sp group"):
        groups["sp"]


def _threads_after_making_groups(rank, world):
    """This process's thread count, then two more groups made (each gloo group has threads)."""
    import os
    threads = len(os.listdir("/proc/self/task"))
    Mesh.build(dp=2)
    Mesh.build(dp=2)
    return threads


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_the_test_ranks_free_the_groups_each_test_made():
    """The harness's reused ranks drop a test's groups when it ends: without that each gloo group's
    polling threads stayed, and a full suite slowed step by step past CI's time limit."""
    counts = [run_ranks(2, _threads_after_making_groups)[0] for _ in range(4)]
    assert counts[-1] <= counts[1] + 1, f"threads per rank before each task: {counts}"
