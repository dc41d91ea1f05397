"""ZeRO++ (zeropp.py) on 4 gloo ranks laid over 2 simulated nodes of 2: the ledger's intra- and
cross-node bytes per step against closed forms, each quantized message within its bound, the
trained result within the quantization's reach of plain ZeRO-3 and of one device, hpZ exact and
its memory as estimated, and ZeRO-3 without options as it was.

The closed forms (zeropp.py's table). dp N = 4 on M = 2 nodes of K = 2; a unit of P numbers
(padded), shard s = P / N; w bytes a weight, g a gradient on the wire (bf16-mixed: 2 and 2);
q_b(n) = ceil(n b / 8) + 4 ceil(n / 256), n numbers at b bits with one fp32 scale per 256.
Per rank, summed over the units:

    plain   dp/all_gather (N-1) s w, twice        dp/reduce_scatter (N-1) s g
    qwZ     dp/all_gather (N-1) q_8(s) + (N-1) s w (the backward gather stays plain)
    hpZ     dp/all_gather (N-1) s w (forward)     dp_intra/all_gather (K-1) (P/K) w
    qgZ     dp_intra/all_to_all (K-1) q_4(M s)    dp_cross/all_to_all (M-1) q_4(s)

Which bytes cross: the ring gathers of the dp group send all of a rank's bytes across when it is
its node's last (ranks 1 and 3), none otherwise; dp_intra never crosses; dp_cross always does.
"""

import functools
import math
import re

import pytest
import torch
from harness import run_ranks, tiers
from test_data_parallel import GLOBAL_BATCH, OPT, SEQ, global_batch, new_model

from minipar.collectives import all_gather
from minipar.data_parallel import param_groups
from minipar.mesh import Mesh, MeshLayout
from minipar.model import get_config
from minipar.parallelize import adamw, build_grad_sync, check_zero
from minipar.planning.estimate import held_bytes
from minipar.planning.traffic import bytes_sent
from minipar.precision import FULL, resolve
from minipar.quantize import qmax
from minipar.run.config import TrainConfig
from minipar.run.step import begin_step
from minipar.run.train import train_step
from minipar.zeropp import check, dp_per_node, pack, parse, quantized_reduce_scatter, split_dp_by_node, unpack

N, K, M = 4, 2, 2
BLOCK = 256
MIXED = resolve("bf16-mixed")


def q(n: int, bits: int) -> int:
    """Bytes of n numbers at `bits` bits, with one 4-byte scale per block of 256 (no padding sent)."""
    return math.ceil(n * bits / 8) + 4 * math.ceil(n / BLOCK)


def _wrapper(mesh, options, precision=FULL):
    if {"hpz", "qgz"} & set(options):
        split_dp_by_node(mesh)
    model = new_model().float() if precision.mixed else new_model()
    z = build_grad_sync(model, mesh.groups(), param_groups(model, OPT), lambda pgs: adamw(pgs, OPT.lr), zero=3,
                        precision=precision, zeropp=options)
    return model, z


def _my_rows(rank, step=0):
    x, y = global_batch(step)
    per = GLOBAL_BATCH // N
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


# -- bytes -------------------------------------------------------------------------------------


def _bytes_of_a_step(rank, world, options):
    with Mesh.build(dp=world, ranks_per_node=K) as mesh:
        _, z = _wrapper(mesh, options, MIXED)
        mesh.ledger.reset()
        train_step(z, [_my_rows(rank)], grad_clip=1.0)
        return [b.padded for b in z.buckets], mesh.ledger.snapshot()


def expected(options, padded, rank):
    """{ledger key: (sent, cross)} for this rank, by the closed forms above (bf16: w = g = 2)."""
    w = g = 2
    last = rank % K == K - 1
    ring = lambda sent: (sent, sent if last else 0)  # noqa: E731 - the ring's crossing rule
    forward = sum((N - 1) * (q(p // N, 8) if "qwz" in options else p // N * w) for p in padded)
    backward = sum((K - 1) * p // K * w if "hpz" in options else (N - 1) * p // N * w for p in padded)
    out = {"dp/all_gather": ring(forward + (0 if "hpz" in options else backward))}
    if "hpz" in options:
        out["dp_intra/all_gather"] = (backward, 0)
    if "qgz" in options:
        out["dp_intra/all_to_all"] = (sum((K - 1) * q(M * p // N, 4) for p in padded), 0)
        out["dp_cross/all_to_all"] = (sum((M - 1) * q(p // N, 4) for p in padded),) * 2
    else:
        out["dp/reduce_scatter"] = ring(sum((N - 1) * p // N * g for p in padded))
    return out


OPTION_SETS = [(), ("qwz",), ("hpz",), ("qgz",), ("qwz", "hpz", "qgz")]


@functools.cache
def bytes_of_a_step(options):
    """Each rank's (padded units, ledger) over one bf16-mixed step; run once per option set."""
    return run_ranks(N, _bytes_of_a_step, options)


@pytest.mark.parametrize("options", tiers(OPTION_SETS, fast=4, tuple_values=True), ids=lambda o: ",".join(o) or "plain")
def test_each_options_intra_and_cross_node_bytes_equal_the_closed_form(options):
    plain_norms = None
    for rank, (padded, ledger) in enumerate(bytes_of_a_step(options)):
        moved = {k: v for k, v in ledger.items() if not k.endswith("all_reduce")}
        assert {k: (v["sent"], v["cross"]) for k, v in moved.items()} == expected(options, padded, rank), rank
        norms = {k: v["sent"] for k, v in ledger.items() if k.endswith("all_reduce")}  # the norm's scalars
        assert plain_norms is None or norms == plain_norms
        plain_norms = norms


@pytest.mark.parametrize("options", tiers(OPTION_SETS, fast=4, tuple_values=True), ids=lambda o: ",".join(o) or "plain")
def test_the_estimate_of_each_options_bytes_equals_the_ledger(options):
    cfg = TrainConfig(model="tiny", dp=N, zero=3, precision="bf16-mixed", ranks_per_node=K, seq_len=SEQ,
                      zeropp=",".join(options) or None, global_batch=GLOBAL_BATCH, micro_batch=GLOBAL_BATCH // N,
                      weight_decay=OPT.weight_decay)
    estimate = {k: v for k, v in bytes_sent(get_config("tiny"), cfg).items() if k.startswith("dp")}
    for _, ledger in bytes_of_a_step(options):
        assert {k: v["sent"] for k, v in ledger.items() if v["sent"]} == estimate


def test_all_three_send_four_and_a_half_times_fewer_bytes_across_nodes_than_plain_zero3():
    # Over the group, the bytes that cross: plain M * 3 (N-1) s * 2 = 9 P per unit; all three
    # M (N-1) q_8(s) + N (M-1) q_4(s) = 6 (s + 4 c) + 4 (s/2 + 4 c) = 2 P + 40 c, with c = ceil(s / 256)
    # scales a shard: 4.5x fewer but for the scales (the paper's 4x is the limit of large N and M).
    def across(options):
        runs = bytes_of_a_step(options)
        moved = [e for _, ledger in runs for k, e in ledger.items() if not k.endswith("all_reduce")]
        return sum(e["cross"] for e in moved), runs[0][0]

    (plain, padded), (plus, _) = across(()), across(("qwz", "hpz", "qgz"))
    assert plain == sum(9 * p for p in padded)
    assert plus == sum(2 * p + 40 * math.ceil(p // N / BLOCK) for p in padded)
    assert 4.0 < plain / plus <= 4.5, plain / plus


# -- accuracy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_a_packed_message_is_within_half_a_scale_of_each_number_per_block(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(1000, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-8, 8, (1000,), generator=g)
    x[37] = 1e4  # an outlier costs its own block only
    wire = pack(x, bits)
    assert wire.numel() == q(1000, bits)
    back = unpack(wire, 1000, bits, torch.float64)
    blocks = torch.nn.functional.pad(x, (0, -1000 % BLOCK)).view(-1, BLOCK)
    scale = (blocks.abs().amax(1) / qmax(bits)).float().double()  # fp32, rounded up by at most one ulp
    bound = (scale * (1 + 2**-23) / 2).repeat_interleave(BLOCK)[:1000]
    assert ((back - x).abs() <= bound).all()  # each block by its own scale: the outlier's costs only block 0
    assert bound[BLOCK:].max() < bound[0] / 10


def _reduce(rank, world, bits):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(N * 300, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-4, 4, (N * 300,), generator=g)
    with Mesh.build(dp=world, ranks_per_node=K) as mesh:
        split_dp_by_node(mesh)
        groups = mesh.groups()
        mine = quantized_reduce_scatter(x, groups["dp_intra"], groups["dp_cross"], bits)
        every = all_gather(x[None], groups.dp)  # [N, P]: every rank's input
        return mine, every, groups.dp.rank


@pytest.mark.parametrize("bits", tiers([4, 8], fast=0))
def test_two_hop_quantized_reduce_scatter_is_the_sum_within_the_rounding_of_both_hops(bits):
    # Hop 1 rounds each rank's input by at most A_r / (2 qmax) (A_r: its largest magnitude, over
    # any of its blocks); the node's sum, quantized again, by at most (its largest) / (2 qmax) <=
    # (sum of its ranks' A_r + hop 1's error) / (2 qmax). So the slice is within
    # (sum_r A_r) / qmax * (1 + 1/(2 qmax)) of the exact sum, fp32 scales' ulp aside (x 1.001).
    for mine, every, d in run_ranks(N, _reduce, bits):
        exact = every.sum(0).view(N, -1)[d]
        bound = every.abs().amax(1).sum() / qmax(bits) * (1 + 1 / (2 * qmax(bits))) * 1.001
        assert mine.dtype == torch.float64 and mine.shape == exact.shape
        assert (mine - exact).abs().max() <= bound


def _grads_and_loss(rank, world, options):
    with Mesh.build(dp=world, ranks_per_node=K) as mesh:
        model, z = _wrapper(mesh, options)
        names = {id(p): n for n, p in model.named_parameters()}
        x, y = _my_rows(rank)
        loss = z(x, y, begin_step(z, [(x, y)]))  # this rank's token losses / (count / N)
        loss.backward()
        z.finish_grad_sync()
        grads = {}
        for b in z.buckets:  # this rank's slice of each bucket's mean gradient, gathered whole
            whole = all_gather(b.grad_slice, b.group)
            grads.update({names[id(p)]: v.clone() for p, v in zip(b.params, b.views(whole))})
        loss = all_gather(loss.detach()[None], mesh.groups().dp).mean()  # the global batch's mean
        z.clip_and_step(1.0)
        with z.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return float(loss), grads, params


@functools.cache
def stepped(options):
    """Each rank's (loss, gradients, weights after the step) under `options`; run once per option set."""
    return run_ranks(N, _grads_and_loss, options)


def single_device_step():
    model = new_model()
    x, y = global_batch(0)
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, model


def largest_rank_gradient(rank):
    """The largest magnitude qgZ quantizes on `rank` at hop 1: its own gradient of the global mean
    loss, before any sum (mean over its N-th of the batch, / N)."""
    model = new_model()
    model(*_my_rows(rank)).backward()
    return max(p.grad.abs().max() for p in model.parameters()) / N


def test_hpz_alone_is_exact_and_plain_zero3_is_unchanged_bit_for_bit():
    # hpZ moves the same numbers by another route: bitwise the plain ZeRO-3 step, which is itself
    # the single device to float64's rounding (and ZeRO-3 without options is today's: test_zero3).
    plain, hpz = stepped(()), stepped(("hpz",))
    for (l0, g0, p0), (l1, g1, p1) in zip(plain, hpz):
        assert l0 == l1 and all(torch.equal(g0[n], g1[n]) for n in g0) and all(torch.equal(p0[n], p1[n]) for n in p0)
    loss, grads, _ = single_device_step()
    assert plain[0][0] == pytest.approx(loss, rel=1e-12)
    for n, ref in grads.items():
        torch.testing.assert_close(plain[0][1][n], ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("options", tiers([("qwz",), ("qgz",), ("qwz", "hpz", "qgz")], fast=2, tuple_values=True),
                         ids=",".join)
def test_quantized_steps_stay_within_the_quantizations_reach_of_one_device(options):
    loss, grads, model = single_device_step()
    plain, got = stepped(())[0], stepped(options)
    largest = max(g.abs().max() for g in grads.values())
    # qwZ moves each weight by at most 1/254 of its block's largest; to first order the loss moves by
    # at most sum |dL/dw| |dw| <= ||g||_1 max|w| / 254 (x 2: second order and a margin).
    l1 = sum(g.abs().sum() for g in grads.values())
    weight_max = max(p.detach().abs().max() for p in model.parameters())
    loss_tol = 2 * l1 * weight_max / (2 * qmax(8)) if "qwz" in options else 1e-12 * loss
    # Gradients: qgZ's two int4 hops move each by <= (sum over ranks of the largest it quantizes) / 7
    # x (1 + 1/14) x 1.001 (the test above); qwZ's perturbed weights move them by about the weights'
    # relative error, 1/254, of the largest (x 4 margin). The sum of the two when both are on.
    hops = sum(largest_rank_gradient(r) for r in range(N)) / qmax(4) * (1 + 1 / 14) * 1.001
    grad_tol = (hops if "qgz" in options else 0) + (4 * largest / 254 if "qwz" in options else 0)
    for l_, g_, p_ in got:
        assert abs(l_ - loss) <= loss_tol and abs(l_ - plain[0]) <= loss_tol
        for n, ref in grads.items():
            assert (g_[n] - ref).abs().max() <= grad_tol, n
        # One AdamW step moves each weight by lr * m / sqrt(v) = lr * sign(g) (and decay): whatever the
        # quantization did to a gradient, the weights differ from plain ZeRO-3's by at most 2 lr.
        assert all((p_[n] - plain[2][n]).abs().max() <= 2 * OPT.lr * (1 + 1e-9) for n in p_)


# -- memory ------------------------------------------------------------------------------------


def _held(rank, world, options):
    with Mesh.build(dp=world, ranks_per_node=K) as mesh:
        _, z = _wrapper(mesh, options, MIXED)
        train_step(z, [_my_rows(rank)], grad_clip=1.0)
        secondary = sum(b.secondary.numel() * b.secondary.element_size() for b in z.buckets
                        if getattr(b, "secondary", None) is not None)
        return z.param_bytes(), secondary, [b.padded for b in z.buckets]


def test_hpz_holds_one_kth_of_the_weights_in_bf16_as_the_estimate_says():
    plain, hpz = run_ranks(N, _held, ()), run_ranks(N, _held, ("hpz",))
    cfg = TrainConfig(model="tiny", dp=N, zero=3, precision="bf16-mixed", ranks_per_node=K, zeropp="hpz",
                      weight_decay=OPT.weight_decay)
    plain_cfg = TrainConfig(model="tiny", dp=N, zero=3, precision="bf16-mixed", weight_decay=OPT.weight_decay)
    model_cfg = get_config("tiny")
    for (bytes0, none, _), (bytes1, secondary, padded) in zip(plain, hpz):
        assert none == 0 and secondary == sum(p // K * 2 for p in padded)  # P/K bf16 numbers a unit
        assert bytes1 - bytes0 == secondary
        assert held_bytes(model_cfg, cfg)["params"] - held_bytes(model_cfg, plain_cfg)["params"] == secondary


# -- flags -------------------------------------------------------------------------------------


def test_zeropp_that_cannot_apply_is_refused_in_one_line():
    two_nodes = MeshLayout(4, dp=4, ranks_per_node=2)
    assert parse(" qwz, hpz,qwz") == ("qwz", "hpz")
    check(("qwz", "hpz"), two_nodes)  # they apply: no error
    check(("qwz",), MeshLayout(4, dp=4))
    refusals = [(("qgz", MeshLayout(4, dp=4)), "--zeropp qgz splits the dp ranks by node, and this run has one"),
                (("hpz", MeshLayout(4, dp=2, cp=2, ranks_per_node=2), 2), "but --cp reduce gradients"),
                (("qgz", two_nodes, 1, 8), "but the experts reduce gradients"),
                (("", two_nodes), "--zeropp : choose any of qwz, hpz, qgz"),
                # tp 3 on nodes of 4: a node holds 4/3 of a dp rank's ranks
                (("hpz", MeshLayout(12, dp=4, tp=3, ranks_per_node=4)), "4 ranks per node hold 1.33333 ranks")]
    for args, line in refusals:
        with pytest.raises(ValueError, match=re.escape(line)):
            check(parse(args[0]), *args[1:])
    with pytest.raises(ValueError, match=re.escape("--zeropp hpz needs --zero 3")):  # the stage: parallelize.check_zero
        check_zero(2, zeropp=("hpz",))
    assert dp_per_node(MeshLayout(8, dp=4, tp=2, ranks_per_node=4)) == 2  # dp ranks {0,1} and {2,3} share nodes
    assert dp_per_node(MeshLayout(8, dp=2, tp=4, ranks_per_node=2)) == 1  # tp spans nodes: one dp rank each
