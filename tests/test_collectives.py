"""Each collective equals the local computation on the gathered inputs; the ledger counts sizes."""

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks, run_ranks_once, tiers

from minipar import autograd_ops as A
from minipar import collectives as C
from minipar.mesh import Mesh


def _rank_tensor(rank, shape=(4, 6)):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _every_collective(rank, world):
    with Mesh.build(dp=world) as mesh:
        group, ledger = mesh.groups().dp, mesh.ledger
        inputs = [_rank_tensor(r) for r in range(world)]  # what every rank holds, known to all
        x = inputs[rank]
        nbytes = x.numel() * x.element_size()

        t = x.clone()
        C.all_reduce(t, group)
        torch.testing.assert_close(t, sum(inputs), rtol=1e-12, atol=1e-12)
        t = x.clone()
        C.all_reduce(t, group, op="max")
        torch.testing.assert_close(t, torch.stack(inputs).amax(0), rtol=0, atol=0)

        torch.testing.assert_close(C.all_gather(x, group, dim=1), torch.cat(inputs, dim=1), rtol=0, atol=0)

        big = torch.cat([xx.repeat(world, 1) for xx in [x]])  # [4*world, 6]
        full = sum(torch.cat([i.repeat(world, 1)]) for i in inputs)
        torch.testing.assert_close(C.reduce_scatter(big, group), full.chunk(world)[rank], rtol=1e-12, atol=1e-12)

        t = x.clone()
        C.broadcast(t, group, src=world - 1)
        torch.testing.assert_close(t, inputs[world - 1], rtol=0, atol=0)

        a2a_in = torch.cat([x[:, :1] + 10 * j for j in range(world)], dim=1)  # chunk j -> rank j
        expected = torch.cat([inputs[r][:, :1] + 10 * rank for r in range(world)], dim=1)
        torch.testing.assert_close(C.all_to_all(a2a_in, group, dim=1), expected, rtol=0, atol=0)

        t = x.clone()
        C.ring_all_reduce(t, group)
        torch.testing.assert_close(t, sum(inputs), rtol=1e-12, atol=1e-12)

        n = world
        return dict(
            ledger={k: dict(v) for k, v in ledger.snapshot().items()},
            nbytes=nbytes,
            expect={
                "dp/all_reduce": dict(calls=2, bytes=2 * nbytes, sent=2 * (2 * (n - 1) * nbytes // n)),
                "dp/all_gather": dict(calls=1, bytes=n * nbytes, sent=(n - 1) * nbytes),
                "dp/reduce_scatter": dict(calls=1, bytes=n * nbytes, sent=(n - 1) * nbytes),
                "dp/broadcast": dict(calls=1, bytes=nbytes, sent=nbytes),
                "dp/all_to_all": dict(calls=1, bytes=x[:, :1].numel() * 8 * n, sent=(n - 1) * x[:, :1].numel() * 8),
                # ring all-reduce: 2(n-1) sends and receives of one chunk of nbytes/n each
                "dp/send": dict(calls=2 * (n - 1), bytes=2 * (n - 1) * nbytes // n, sent=2 * (n - 1) * nbytes // n),
                "dp/recv": dict(calls=2 * (n - 1), bytes=2 * (n - 1) * nbytes // n, sent=0),
            },
        )


def _on_one_node(expect: dict) -> dict:
    """One node (the mesh's default): every byte sent stays inside it."""
    return {key: {**e, "intra": e["sent"], "cross": 0} for key, e in expect.items()}


@pytest.mark.parametrize("world", tiers([2, 4], fast=1))
def test_collectives_equal_local_computation_and_ledger_counts_tensor_sizes(world):
    for r in run_ranks_once(world, _every_collective):
        assert r["ledger"] == _on_one_node(r["expect"])


def test_ring_all_reduce_sends_two_n_minus_one_over_n_of_the_tensor():
    # The formula in ring_bytes_sent matches what the hand-written ring really sends (4 ranks).
    out = run_ranks_once(4, _every_collective)
    for r in out:
        assert r["ledger"]["dp/send"]["sent"] == C.ring_bytes_sent("all_reduce", r["nbytes"], 4)


def _autograd_ops(rank, world):
    """f/g and their sequence-parallel versions: forward and backward are the conjugate collectives."""
    with Mesh.build(tp=world) as mesh:
        g = mesh.groups().tp
        inputs = [_rank_tensor(r) for r in range(world)]
        grads = [_rank_tensor(r + 50) for r in range(world)]

        x = inputs[rank].clone().requires_grad_()
        y = A.copy_to_parallel(x, g)
        y.backward(grads[rank])
        torch.testing.assert_close(y, inputs[rank], rtol=0, atol=0)
        torch.testing.assert_close(x.grad, sum(grads), rtol=1e-12, atol=1e-12)

        x = inputs[rank].clone().requires_grad_()
        y = A.reduce_from_parallel(x, g)
        y.backward(grads[rank])
        torch.testing.assert_close(y, sum(inputs), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, grads[rank], rtol=0, atol=0)

        # Sequence parallelism's f: all-gather forward; backward, the sum of every rank's gradient
        # of the whole sequence, of which each keeps its slice (a reduce-scatter).
        x = inputs[rank].clone().requires_grad_()
        y = A.gather_from_sequence_parallel(x, g, dim=1)
        torch.testing.assert_close(y, torch.cat(inputs, dim=1), rtol=0, atol=0)
        y.backward(torch.cat([grads[rank]] * world, dim=1))
        torch.testing.assert_close(x.grad, sum(grads), rtol=1e-12, atol=1e-12)

        # Its g: reduce-scatter forward (the sum, this rank's slice), all-gather backward.
        x = torch.cat(inputs, dim=1).clone().requires_grad_()
        y = A.reduce_scatter_to_sequence_parallel(x, g, dim=1)
        torch.testing.assert_close(y, world * inputs[rank], rtol=1e-12, atol=1e-12)
        y.backward(grads[rank])
        torch.testing.assert_close(x.grad, torch.cat(grads, dim=1), rtol=0, atol=0)
    return dist.get_rank()


def test_autograd_operators_run_the_conjugate_collective_in_backward():
    assert run_ranks(4, _autograd_ops) == [0, 1, 2, 3]


def test_single_rank_ops_send_nothing():
    ledger = C.Ledger()
    assert C.ring_bytes_sent("all_reduce", 1000, 1) == 0
    ledger.record("tp", "all_reduce", 8, 0)
    ledger.record("tp", "all_reduce", 8, 0)
    assert ledger.get("tp", "all_reduce").calls == 2
    ledger.reset()
    assert ledger.get("tp", "all_reduce").calls == 0


def _uneven_all_to_all(rank, world):
    """Rank r sends r + j + 1 rows to rank j; the backward sends each gradient row home."""
    with Mesh.build(dp=world) as mesh:
        g = mesh.groups().dp
        send = [rank + j + 1 for j in range(world)]
        recv = [r + rank + 1 for r in range(world)]  # what rank r sends to this one
        x = (torch.arange(sum(send), dtype=torch.float64) + 100 * rank).unsqueeze(1).repeat(1, 3).requires_grad_()
        y = A.all_to_all_with_grad(x, g, 0, send, recv)
        expected = torch.cat([(torch.arange(sum(r + j + 1 for j in range(world)), dtype=torch.float64) + 100 * r)
                              .split([r + j + 1 for j in range(world)])[rank] for r in range(world)])
        torch.testing.assert_close(y[:, 0], expected, rtol=0, atol=0)
        (y * (rank + 1)).sum().backward()  # each received row's gradient names the receiver
        owners = torch.cat([torch.full((n,), j + 1.0, dtype=torch.float64) for j, n in enumerate(send)])
        torch.testing.assert_close(x.grad[:, 0], owners, rtol=0, atol=0)
        entry = mesh.ledger.get("dp", "all_to_all")
        row = 3 * 8
        return entry.calls, entry.sent, (sum(send) - send[rank]) * row + (sum(recv) - recv[rank]) * row


@pytest.mark.parametrize("world", tiers([2, 3], fast=0))
def test_all_to_all_with_uneven_splits_and_its_backward(world):
    for calls, sent, expected in run_ranks(world, _uneven_all_to_all):
        assert calls == 2 and sent == expected  # forward and backward, each counting what it sent away


def _rooted_collectives(rank, world):
    with Mesh.build(dp=world) as mesh:
        group, ledger = mesh.groups().dp, mesh.ledger
        inputs = [_rank_tensor(r) for r in range(world)]  # [4, 6] each, known to every rank
        root = world - 1  # not rank 0, so a root argument that is ignored shows
        got = C.reduce(inputs[rank].clone(), group, dst=root)
        assert (got is None) == (rank != root)
        if rank == root:
            torch.testing.assert_close(got, sum(inputs), rtol=1e-12, atol=1e-12)
        got = C.gather(inputs[rank], group, dst=root)
        assert (got is None) == (rank != root)
        if rank == root:
            torch.testing.assert_close(got, torch.cat(inputs), rtol=0, atol=0)
        full = torch.cat([inputs[root]] * world) if rank == root else torch.zeros(4 * world, 6, dtype=torch.float64)
        torch.testing.assert_close(C.scatter(full, group, src=root), inputs[root], rtol=0, atol=0)  # chunk i = root's
        C.barrier(group)
        nbytes = inputs[rank].numel() * 8
        assert ledger.get("dp", "reduce").sent == (0 if world == 1 else nbytes)
        assert ledger.get("dp", "gather").sent == (0 if rank == root else nbytes)
        assert ledger.get("dp", "gather").bytes == world * nbytes
        assert ledger.get("dp", "scatter").sent == ((world - 1) * nbytes if rank == root else 0)
        assert (ledger.get("dp", "barrier").calls, ledger.get("dp", "barrier").sent) == (1, 0)
        return True


@pytest.mark.parametrize("world", tiers([2, 4], fast=1))
def test_reduce_gather_scatter_and_barrier_equal_local_computation_on_their_root(world):
    assert all(run_ranks(world, _rooted_collectives))
