"""Context parallelism: ring attention equals SDPA; the model at cp equals one device; 4D training."""

import pytest
import torch
import torch.nn.functional as F
from einops import repeat
from harness import parallel_llama, run_ranks, tiers

from minipar import context_parallel as C
from minipar.collectives import Group
from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw, build_grad_sync
from minipar.run.config import TrainConfig
from minipar.run.train import train_step
from minipar.tensor_parallel import unshard

TIGHT = dict(rtol=1e-10, atol=1e-12)
S = 16


def qkv(seed=0, b=2, h=4, h_kv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, S, d, generator=g, dtype=torch.float64) for n in (h, h_kv, h_kv)]


def reference_attention(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = (repeat(t, "b h s d -> b (h g) s d", g=g) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk_and_equal_causal_work():
    assert C.zigzag_positions(0, 2, 8).tolist() == [0, 1, 6, 7]
    assert C.zigzag_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    for cp in (2, 4):
        positions = [C.zigzag_positions(r, cp, 64) for r in range(cp)]
        assert sorted(torch.cat(positions).tolist()) == list(range(64))
        work = [int((p + 1).sum()) for p in positions]  # keys each rank's queries attend to
        assert len(set(work)) == 1
    with pytest.raises(ValueError, match="not divisible by 2 x --cp"):
        C.check_cp_layout(10, 4)


def _equal_to_sdpa(attend, g, h=None, h_kv=None):
    """Run `attend` (ring or Ulysses) on this rank's zigzag share of q, k, v and a random output
    gradient; assert its output and the gradients of q, k, v equal one device's SDPA on the whole
    sequence. Returns this rank's inputs and the output gradient, for a second run."""
    q, k, v = qkv() if h is None else qkv(h=h, h_kv=h_kv)
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    local = [C.split_sequence(t, g, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = attend(*local, g, S)
    out.backward(C.split_sequence(d_out, g, dim=2))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = reference_attention(*ref)
    ref_out.backward(d_out)
    torch.testing.assert_close(out, C.split_sequence(ref_out, g, dim=2), **TIGHT)
    for mine, theirs, name in zip(local, ref, "qkv"):
        torch.testing.assert_close(mine.grad, C.split_sequence(theirs.grad, g, dim=2), **TIGHT, msg=name)
    return local, d_out, k


def _ring(rank, world):
    with Mesh.build(cp=world) as mesh:
        _, _, k = _equal_to_sdpa(C.ring_attention, mesh.groups().cp)
        kv_bytes = 2 * k.numel() // world * 8
        return dict(sent=mesh.ledger.get("cp", "send").bytes, kv_bytes=kv_bytes)


@pytest.mark.parametrize("cp", tiers([2, 4], fast=1))
def test_ring_attention_forward_and_backward_equal_sdpa_causal_gqa(cp):
    for r in run_ranks(cp, _ring):
        # forward: cp-1 hops of this rank's K/V; backward: cp hops of K, V, dK, dV
        assert r["sent"] == (cp - 1) * r["kv_bytes"] + cp * 2 * r["kv_bytes"]


# ----------------------------------------------------------------------------------------------
# Ulysses: two all-to-alls instead of the ring
# ----------------------------------------------------------------------------------------------


def _ulysses(rank, world, h, h_kv):
    with Mesh.build(cp=world) as mesh:
        g = mesh.groups().cp
        local, d_out, _ = _equal_to_sdpa(C.ulysses_attention, g, h, h_kv)
        entry = mesh.ledger.get("cp", "all_to_all")
        # The same attention by the ring, on the same ranks: its K/V hops, next to its formula.
        C.ring_attention(*local, g, S).backward(C.split_sequence(d_out, g, dim=2))
        return dict(calls=entry.calls, sent=entry.sent, ring=mesh.ledger.get("cp", "send").sent)


@pytest.mark.parametrize("cp,h,h_kv", tiers([(2, 4, 2), (4, 8, 4), (2, 4, 4)], fast=1),
                         ids=["cp2-gqa", "cp4-gqa", "cp2-mha"])
def test_ulysses_attention_forward_and_backward_equal_sdpa_and_send_the_closed_form(cp, h, h_kv):
    tokens, d, w = 2 * S // cp, 8, 8  # b s/cp, head dim, float64
    for r in run_ranks(cp, _ulysses, h, h_kv):
        assert r["calls"] == 8  # q, k, v there and the output back; the same four carrying gradients
        # Each all-to-all keeps 1/cp of its [b, heads, s/cp, d] and sends the rest: by hand, then the formula.
        assert r["sent"] == 2 * (2 * h + 2 * h_kv) * tokens * d * w * (cp - 1) // cp
        assert r["sent"] == C.attention_bytes_sent("ulysses", tokens, h, h_kv, d, cp, w, w)
        assert r["ring"] == (cp - 1) * 2 * tokens * h_kv * d * w + cp * 4 * tokens * h_kv * d * w
        assert r["ring"] == C.attention_bytes_sent("ring", tokens, h, h_kv, d, cp, w, w)


def test_ulysses_refuses_heads_that_do_not_split_over_cp_in_one_line():
    C.check_cp_layout(16, 2, "ulysses", n_heads=4, n_kv_heads=2)  # 2 and 1 heads per cp rank
    with pytest.raises(ValueError, match="1 kv heads must both divide by --cp 2"):
        C.check_cp_layout(16, 2, "ulysses", n_heads=4, n_kv_heads=2, tp=2)  # tp leaves 1 kv head per rank
    with pytest.raises(ValueError, match="2 query heads and 2 kv heads must both divide by --cp 4"):
        C.check_cp_layout(16, 4, "ulysses", n_heads=4, n_kv_heads=4, tp=2)
    C.check_cp_layout(16, 4, "ring", n_heads=4, n_kv_heads=4, tp=2)  # the ring takes any heads
    with pytest.raises(ValueError, match="cp_attention 'ulyses': choose one of ring, ulysses"):
        C.install_context_parallel(Llama(CFG).layers["0"].attn, Group.solo("cp"), "ulyses")  # no silent ring


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

CFG = get_config("tiny", n_layers=2, vocab_size=250)


def batch(seed=0, rows=4, ignore=True):
    x = torch.randint(0, 250, (rows, S), generator=torch.Generator().manual_seed(seed))
    y = torch.roll(x, -1, dims=1)
    if ignore:  # ignored targets, unevenly spread over the cp ranks
        y[0, 3] = y[1, 9] = -100
    return x, y


def _model_at_cp(rank, world):
    with Mesh.build(cp=world) as mesh:
        g = mesh.groups().cp
        model = parallel_llama(CFG, seed=2, cp_group=g).double()
        x, y = batch()
        loss = model(C.split_sequence(x, g), C.split_sequence(y, g))
        loss.backward()
        return dict(loss=loss.item(), grads={n: p.grad for n, p in model.named_parameters()})


def test_model_loss_and_every_gradient_at_cp2_equal_single_device():
    model = Llama(CFG, seed=2).double()
    loss = model(*batch())
    loss.backward()
    out = run_ranks(2, _model_at_cp)
    # Each rank's loss is its token share of the mean, times cp: their average is the token mean,
    # and the dp x cp gradient average (here: cp only) is the single-device gradient.
    assert sum(r["loss"] for r in out) / 2 == pytest.approx(loss.item(), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(sum(r["grads"][n] for r in out) / 2, p.grad, **TIGHT, msg=n)


def _model_at_layout(rank, world, degrees, cfg, attention):
    with Mesh.build(**degrees) as mesh:
        g, tp = mesh.groups().cp, mesh.groups().tp
        model = parallel_llama(cfg, seed=2, tp_group=tp, cp_group=g, cp_attention=attention).double()
        x, y = batch()
        loss = model(C.split_sequence(x, g), C.split_sequence(y, g))
        loss.backward()
        grads = {n: unshard(p.grad, p, tp) for n, p in model.named_parameters()}  # whole, on every tp rank
        return dict(loss=loss.item(), grads=grads, ledger=mesh.ledger.snapshot(), tp_rank=tp.rank)


ULYSSES_MODELS = [(2, dict(cp=2), CFG),  # 4 query heads, 2 kv heads: 2 and 1 per cp rank
                  (4, dict(tp=2, cp=2), get_config("tiny", n_layers=2, vocab_size=250, n_heads=8, n_kv_heads=4))]


@pytest.mark.parametrize("world,degrees,cfg", tiers(ULYSSES_MODELS, fast=1), ids=["cp2-gqa", "tp2xcp2-gqa"])
def test_model_loss_and_every_gradient_under_ulysses_equal_single_device(world, degrees, cfg):
    model = Llama(cfg, seed=2).double()
    loss = model(*batch())
    loss.backward()
    out = run_ranks(world, _model_at_layout, degrees, cfg, "ulysses")
    cp_ranks = [r for r in out if r["tp_rank"] == 0]  # one of each cp rank's tp ranks: the same loss and grads
    assert sum(r["loss"] for r in cp_ranks) / 2 == pytest.approx(loss.item(), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(sum(r["grads"][n] for r in cp_ranks) / 2, p.grad, **TIGHT, msg=n)
    assert all("cp/send" not in r["ledger"] and r["ledger"]["cp/all_to_all"]["calls"] == 8 * cfg.n_layers
               for r in out)  # no ring: four all-to-alls each way per layer


def _attention_memory(rank, world):
    """Bytes ring attention keeps for backward on this rank (q, k, v, out, lse of its tokens)."""
    with Mesh.build(cp=world) as mesh:
        local = [C.split_sequence(t, mesh.groups().cp, dim=2).requires_grad_() for t in qkv()]
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            C.ring_attention(*local, mesh.groups().cp, S)
        return dict(bytes=sum(t.numel() * t.element_size() for t in saved),
                    longest=max(t.shape[2] for t in saved))  # q, k, v, out [b, h, s, d]; lse [b, h, s]


def test_attention_activation_memory_per_rank_falls_as_one_over_cp():
    one, two, four = (run_ranks(cp, _attention_memory)[0] for cp in (1, 2, 4))
    assert two["bytes"] * 2 == one["bytes"] and four["bytes"] * 4 == one["bytes"]
    assert four["longest"] == S // 4  # nothing kept spans the whole sequence (no [s, s] scores, no full K/V)


# ----------------------------------------------------------------------------------------------
# Training: cp2 with dp2, tp2, pp2 (4 ranks) and two at once (8 ranks) equal one device
# ----------------------------------------------------------------------------------------------

OPT = TrainConfig(lr=1e-2, weight_decay=0.1)
STEPS, ROWS = 2, 4


def single_device_training(n_layers):
    model = Llama(get_config("tiny", n_layers=n_layers, vocab_size=250), seed=2).double()
    opt = adamw(param_groups(model, OPT), OPT.lr)
    for step in range(STEPS):
        model(*batch(step, ROWS, ignore=False)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _train(rank, world, degrees, zero, sp):
    from minipar.pipeline.executor import Pipeline

    with Mesh.build(**degrees) as mesh:
        cfg = get_config("tiny", n_layers=4, vocab_size=250)
        pipeline = (Pipeline(mesh.groups().pp, "1f1b", cfg.n_layers, seq_shards=mesh.layout.tp if sp else 1)
                    if mesh.layout.pp > 1 else None)
        model = parallel_llama(cfg, seed=2, tp_group=mesh.groups().tp, sequence_parallel=sp, cp_group=mesh.groups().cp,
                      layer_ids=pipeline.my_layers() if pipeline else None,
                      embed=pipeline.holds_first() if pipeline else True,
                      head=pipeline.holds_last() if pipeline else True).double()
        # Dense gradients averaged over dp x cp: each cp rank saw only its share of the tokens.
        wrapped = build_grad_sync(model, mesh.groups(), param_groups(model, OPT), lambda pgs: adamw(pgs, OPT.lr),
                                  zero=zero)
        dp = mesh.layout.dp
        per = ROWS // dp
        for step in range(STEPS):
            # No ignored targets here: across dp ranks (unlike cp) the mean is of equal-sized means.
            x, y = batch(step, ROWS, ignore=False)
            rows = slice(mesh.coord("dp") * per, (mesh.coord("dp") + 1) * per)
            x, y = C.split_sequence(x[rows], mesh.groups().cp), C.split_sequence(y[rows], mesh.groups().cp)
            micro = list(zip(x.chunk(2), y.chunk(2))) if pipeline else [(x, y)]
            train_step(wrapped, micro, 0.5, pipeline=pipeline)
        return {n: unshard(p.detach(), p, mesh.groups().tp) for n, p in model.named_parameters()}


LAYOUTS = [
    (4, dict(dp=2, cp=2), 0, False),
    (4, dict(tp=2, cp=2), 0, True),
    (4, dict(pp=2, cp=2), 0, False),
    (4, dict(dp=2, cp=2), 2, False),
    (8, dict(dp=2, tp=2, cp=2), 1, True),
    (8, dict(tp=2, pp=2, cp=2), 0, False),
]


def layout_id(case):
    _, degrees, zero, sp = case
    return "x".join(f"{k}{v}" for k, v in degrees.items()) + f"-zero{zero}-sp{int(sp)}"


@pytest.mark.parametrize("world,degrees,zero,sp", tiers(LAYOUTS, fast=1), ids=[layout_id(c) for c in LAYOUTS])
def test_cp2_training_composed_with_dp_tp_pp_and_zero_equals_single_device(world, degrees, zero, sp):
    ref = single_device_training(4)
    params = {}
    for r in run_ranks(world, _train, degrees, zero, sp, timeout=300):
        params.update(r)
    assert params.keys() == ref.keys()
    for n, p in ref.items():
        torch.testing.assert_close(params[n], p, **TIGHT, msg=n)
