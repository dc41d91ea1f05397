"""Nodes: the mesh knows which ranks share a node, and the ledger splits every rank's sent bytes
into intra-node and cross-node by the link each byte takes (collectives.py's model), checked
against closed forms on 4 gloo ranks laid over 1, 2 and 4 simulated nodes; ZeRO-3's cross-node
bytes per step, the baseline ZeRO++ is measured against.

The closed forms. A group of N ranks with K of them on each node, M = N / K nodes, consecutive
ranks on one node; each rank's share s of an operation of S payload bytes (the ring: s = (N-1)/N S
for an all-gather or a reduce-scatter, 2 (N-1)/N S for an all-reduce, S for a broadcast; send: the
tensor) goes to the next rank of the ring, so it crosses exactly when the rank is the last of its
node and there is more than one node: rank i's cross = s if M > 1 and i % K == K-1, else 0; over
the group M s bytes cross (each node sends s out), (N - M) s stay inside. All-to-all sends S/N to
each other rank: cross = (N - K) S/N, intra = (K - 1) S/N, on every rank.
"""

import pytest
import torch
from harness import run_ranks, tiers
from test_data_parallel import GLOBAL_BATCH, global_batch, new_model
from test_zero3 import zero3

import minipar.collectives as C
from minipar.mesh import LayoutError, Mesh, MeshLayout
from minipar.ops import cli
from minipar.ops.command_line import parse_args
from minipar.run.config import ConfigError
from minipar.run.train import train_step

E = 12  # elements per rank: divisible by every group size here
F64 = 8


def _every_op(rank, world, dp, tp, k):
    """Each operation once over the dp and the tp group; the ledger's entries."""
    torch.manual_seed(rank)
    with Mesh.build(dp=dp, tp=tp, ranks_per_node=k) as mesh:
        for g in (mesh.groups().dp, mesh.groups().tp):
            n, i = g.size, g.rank
            x = torch.randn(E, dtype=torch.float64)
            C.all_gather(x, g)
            C.reduce_scatter(torch.randn(n * E, dtype=torch.float64), g)
            C.all_reduce(x.clone(), g)
            C.broadcast(x.clone(), g, src=0)
            C.all_to_all(torch.randn(n * E, dtype=torch.float64), g)
            if n > 1:
                for work in C.send_recv(x, (i + 1) % n, torch.empty_like(x), (i - 1) % n, g):
                    work.wait()
            C.gather(x, g, dst=0)
            C.scatter(torch.randn(n * E, dtype=torch.float64), g, src=0)
        return mesh.ledger.snapshot()


def shares(n: int) -> dict[str, int]:
    """Each op's bytes sent by one rank of a group of n, for the payloads _every_op hands it."""
    s = n * E * F64  # all_gather's output, reduce_scatter's and all_to_all's input
    return {"all_gather": (n - 1) * s // n, "reduce_scatter": (n - 1) * s // n,
            "all_reduce": 2 * (n - 1) * E * F64 // n, "broadcast": E * F64, "send": E * F64, "recv": 0}


@pytest.mark.parametrize("k", tiers([4, 2, 1], fast=1), ids=["1-node", "2-nodes", "4-nodes"])
def test_cross_node_bytes_of_each_collective_equal_the_closed_form(k):
    n, m = 4, 4 // k
    ledgers = run_ranks(4, _every_op, 4, 1, k)
    for i, ledger in enumerate(ledgers):
        for op, s in shares(n).items():
            cross = s if m > 1 and i % k == k - 1 and op != "recv" else 0
            assert ledger[f"dp/{op}"]["cross"] == cross, (i, op)
            assert ledger[f"dp/{op}"]["intra"] == s - cross == ledger[f"dp/{op}"]["sent"] - cross, (i, op)
        piece = E * F64  # all-to-all: one piece of S/N to each other rank
        assert ledger["dp/all_to_all"]["cross"] == (n - k) * piece
        assert ledger["dp/all_to_all"]["intra"] == (k - 1) * piece
        # gather and scatter go straight between the root (rank 0) and each rank: a byte crosses when
        # its rank lies on another node than the root's, not when the ring's next rank does
        assert ledger["dp/gather"]["cross"] == (piece if i >= k else 0)
        assert ledger["dp/gather"]["intra"] == (piece if 0 < i < k else 0)
        assert ledger["dp/scatter"]["cross"] == ((n - k) * piece if i == 0 else 0)
        assert ledger["dp/scatter"]["intra"] == ((k - 1) * piece if i == 0 else 0)
    # Over the group: each of the m nodes (when m > 1) sends one rank's share across per collective.
    total = sum(ledger["dp/all_gather"]["cross"] for ledger in ledgers)
    assert total == (m * shares(n)["all_gather"] if m > 1 else 0)


def test_dp_crosses_the_nodes_and_tp_stays_inside_one():
    # dp2 x tp2 on 2 nodes of 2: the tp groups {0,1} {2,3} are each one node, the dp groups {0,2}
    # {1,3} span both: every dp byte crosses, no tp byte does.
    for ledger in run_ranks(4, _every_op, 2, 2, 2):
        for op, s in shares(2).items():
            assert (ledger[f"dp/{op}"]["cross"], ledger[f"dp/{op}"]["intra"]) == (s, 0), op
            assert (ledger[f"tp/{op}"]["cross"], ledger[f"tp/{op}"]["intra"]) == (0, s), op
        assert (ledger["dp/all_to_all"]["cross"], ledger["tp/all_to_all"]["intra"]) == (E * F64, E * F64)


def test_the_ledger_adds_up_and_shows_intra_and_cross_node_bytes():
    ledger = C.Ledger()
    ledger.record("dp", "all_gather", 400, 300, cross=300)  # a rank whose next in the ring is elsewhere
    ledger.record("dp", "all_gather", 400, 300)  # one whose next is on its node
    e = ledger.get("dp", "all_gather")
    assert (e.sent, e.intra, e.cross) == (600, 300, 300) and ledger.total_sent() == 600
    header, row = ledger.table().splitlines()
    assert header.split()[-2:] == ["intra-node", "cross-node"] and row.split()[-3:] == ["600", "300", "300"]


def test_tp_groups_stay_inside_a_node_whenever_the_node_holds_whole_tp_groups():
    # tp is innermost: with K a multiple of tp, each tp group lies inside one node's K consecutive ranks.
    for world, tp, k in [(8, 2, 4), (8, 4, 4), (8, 2, 2), (16, 4, 8)]:
        layout = MeshLayout(world, dp=world // tp, tp=tp, ranks_per_node=k)
        assert layout.nodes == world // k
        assert all(len({layout.node(r) for r in g}) == 1 for g in layout.groups("tp"))
        assert all(len({layout.node(r) for r in g}) == min(world // tp, world // k) for g in layout.groups("dp"))
    assert "on 2 nodes of 4" in MeshLayout(8, dp=8, ranks_per_node=4).table()
    assert "nodes" not in MeshLayout(8, dp=8).table() and MeshLayout(8, dp=8).nodes == 1


def test_a_ranks_per_node_that_does_not_divide_the_world_is_refused():
    with pytest.raises(LayoutError, match="--ranks-per-node 3 does not divide the world's 4 ranks"):
        MeshLayout(4, dp=4, ranks_per_node=3)
    with pytest.raises(LayoutError, match="--ranks-per-node 0: give 1 or more"):
        MeshLayout(4, dp=4, ranks_per_node=0)


ARGV = ["--dp=4", "--micro-batch=1", "--no-wandb"]


@pytest.mark.parametrize("flag,line", [("--ranks-per-node=3", "--ranks-per-node 3 does not divide the world's 4"),
                                       ("--ranks-per-node=0", "--ranks-per-node 0: give 1 or more")])
def test_a_bad_ranks_per_node_is_one_line_exit_2(flag, line, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli, "launch_watched", lambda cfg, resume, interrupt, extras=(): pytest.fail("the run started"))
    assert cli.main([*ARGV, flag]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("minipar: error: ") and line in lines[0], lines


def test_ranks_per_node_defaults_to_torchruns_local_world_size_else_one_node(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert parse_args(ARGV).ranks_per_node == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert parse_args(ARGV).ranks_per_node == 2
    assert parse_args([*ARGV, "--ranks-per-node=1"]).ranks_per_node == 1  # the flag wins
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="--ranks-per-node 3 does not divide"):  # the layout's: the run's error
        parse_args(ARGV)
    with pytest.raises(ConfigError, match="--ranks-per-node -1: give 1 or more"):
        parse_args([*ARGV, "--ranks-per-node=-1"])


def _zero3_step(rank, world, k):
    with Mesh.build(dp=world, ranks_per_node=k) as mesh:
        z = zero3(new_model(), mesh.groups())
        psi = sum(b.padded for b in z.buckets) * F64  # the whole (padded) weights, in bytes
        x, y = global_batch(0)
        per = GLOBAL_BATCH // world
        mesh.ledger.reset()
        train_step(z, [(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])], grad_clip=1.0)
        assert mesh.node == rank // k
        return psi, mesh.ledger.snapshot()


def test_zero3_on_two_nodes_sends_three_psi_n_minus_one_over_n_across_from_each_node():
    # ZeRO-3, dp 4 on 2 nodes of 2: each step all-gathers the weights twice (forward, backward) and
    # reduce-scatters the gradients once, each (N-1)/N Psi per rank. Ranks 1 and 3 (last of their
    # node) send all of theirs across, ranks 0 and 2 none: each node sends 3 (N-1)/N Psi across per
    # step, half of the 4 x 3 (N-1)/N Psi the group sends. ZeRO++ (issue #20) is measured against this.
    n, k = 4, 2
    results = run_ranks(n, _zero3_step, k)
    for i, (psi, ledger) in enumerate(results):
        one_psi = (n - 1) * psi // n
        last = i % k == k - 1
        gather, scatter = ledger["dp/all_gather"], ledger["dp/reduce_scatter"]
        assert (gather["sent"], scatter["sent"]) == (2 * one_psi, one_psi)
        assert (gather["cross"], scatter["cross"]) == ((2 * one_psi, one_psi) if last else (0, 0)), i
        assert gather["intra"] + gather["cross"] == gather["sent"] and scatter["intra"] + scatter["cross"] == one_psi
    psi = results[0][0]
    across = sum(ledger["dp/all_gather"]["cross"] + ledger["dp/reduce_scatter"]["cross"] for _, ledger in results)
    assert across == (n // k) * 3 * (n - 1) * psi // n
