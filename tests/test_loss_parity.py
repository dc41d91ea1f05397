"""One loss, whatever the layout: the mean over every real (not -100) target of the global batch.

A batch whose rows carry very different numbers of real targets (none at all in the first four,
so a whole dp rank and whole micro-batches have nothing to learn from) is trained for one step
under accumulation, dp, cp, pp, tp+sp and their compositions with ZeRO. A mean of per-rank or
per-micro-batch means would weigh a row of 2 targets like a row of 16; the layouts must give the
one-device gradient of the token mean instead, in float64, and the one-device loss. The optimizer
is plain SGD at lr 1 without clipping, so each weight moves by exactly its gradient (AdamW's
first step would hide a wrong scale).
"""

import pytest
import torch
from harness import run_ranks, tiers

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import build_grad_sync
from minipar.run.config import TrainConfig

ROWS, SEQ = 8, 16
REAL = [0, 0, 0, 0, 16, 5, 2, 9]  # real targets at the start of each row; the rest are -100
MODEL = dict(vocab_size=256)
TIGHT = dict(rtol=1e-10, atol=1e-12)


def batch():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (ROWS, SEQ), generator=g), torch.randint(0, 256, (ROWS, SEQ), generator=g)
    for row, real in enumerate(REAL):
        y[row, real:] = -100
    return x, y


def one_device(tie_embeddings=False):
    model = Llama(get_config("tiny", **MODEL, tie_embeddings=tie_embeddings), seed=0).double()
    loss = model(*batch())  # F.cross_entropy's mean over the real targets of the whole batch
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def sgd(groups):  # in place of AdamW, for one test: weights move by their gradient
    return torch.optim.SGD(groups, lr=1.0)


def grad_sync(model, mesh, cfg):
    """The run's gradient-sync wrapper for `cfg` (train.py's), holding SGD."""
    return build_grad_sync(model, mesh.groups(), param_groups(model, cfg), sgd, zero=cfg.zero, bucket_mb=cfg.bucket_mb)


def _one_step(rank, world, layout, micro):
    import minipar.run.train as train
    from minipar.context_parallel import split_sequence
    from minipar.tensor_parallel import unshard

    cfg = TrainConfig(model="tiny", seq_len=SEQ, global_batch=ROWS, micro_batch=micro, weight_decay=0.0,
                      grad_clip=0.0, dtype="float64", **layout)
    with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
        model, pipeline = train.build_model(cfg, mesh, get_config("tiny", **MODEL, tie_embeddings=cfg.tie_embeddings),
                                            torch.device("cpu"), torch.float64)
        wrapper = grad_sync(model, mesh, cfg)
        with wrapper.gathered():
            before = {n: unshard(p.detach(), p, mesh.groups()).clone() for n, p in model.named_parameters()}
        per = ROWS // cfg.dp
        x, y = (t[mesh.coord("dp") * per:(mesh.coord("dp") + 1) * per] for t in batch())
        x, y = split_sequence(x, mesh.groups().cp), split_sequence(y, mesh.groups().cp)
        loss, norm = train.train_step(wrapper, list(zip(x.split(micro), y.split(micro))), 0.0, pipeline=pipeline)
        with wrapper.gathered():
            moved = {n: before[n] - unshard(p.detach(), p, mesh.groups()) for n, p in model.named_parameters()}
        holds_loss = pipeline is None or pipeline.holds_last()
        return moved, (loss if holds_loss else None), norm


LAYOUTS = [
    (1, dict(), 2),  # accumulation: 4 micro-batches, the first two without a real target
    (2, dict(dp=2), 2),  # dp rank 0 has no real target at all
    (2, dict(cp=2), 4),
    (2, dict(pp=2), 2),
    (4, dict(dp=2, tp=2, sp=True), 2),
    (8, dict(dp=2, cp=2, pp=2, zero=1), 2),
    (4, dict(dp=2, cp=2, zero=3), 2),  # ZeRO-3 does not run under pp (config.py says why)
    (4, dict(dp=2, pp=2, zero=2, schedule="gpipe"), 1),
    # Tied embeddings: one [V, d] table, its gradient the sum of the embedding's and the head's
    (4, dict(dp=2, tp=2, sp=True, tie_embeddings=True), 2),
    (4, dict(tp=2, cp=2, zero=1, tie_embeddings=True), 4),
    (2, dict(dp=2, zero=3, tie_embeddings=True), 2),  # the table is in ZeRO-3's embedding and head units
    # Selective recompute (--recompute-mlp): each MLP replayed in backward, its f and g (sp: all-gather and
    # reduce-scatter) included; under ZeRO-3 on the layer's backward gather; under pp inside each stage
    (1, dict(recompute_mlp=True), 2),
    (2, dict(tp=2, recompute_mlp=True), 2),
    (4, dict(dp=2, tp=2, sp=True, zero=3, recompute_mlp=True), 2),
    (4, dict(tp=2, pp=2, sp=True, recompute_mlp=True), 2),
    # --recompute-selective: each layer replays its norms, RoPE, SiLU and products (and under sp the gathers
    # that feed its matmuls), the matmuls' and attention's outputs kept; under ZeRO-3 and pp alike
    (1, dict(recompute_selective=True), 2),
    (2, dict(tp=2, recompute_selective=True), 2),
    (4, dict(dp=2, tp=2, sp=True, zero=3, recompute_selective=True), 2),
    (4, dict(tp=2, pp=2, sp=True, recompute_selective=True), 2),
    (4, dict(dp=2, cp=2, recompute_selective=True), 4),
    (2, dict(cp=2, cp_attention="ulysses", recompute_selective=True), 4),
]


# fast: ZeRO-3 x cp; tied; --recompute-mlp; --recompute-selective
@pytest.mark.parametrize("world,layout,micro", tiers(LAYOUTS, fast=[6, 8, 13, 17]),
                         ids=["-".join(f"{k}{v}" for k, v in c[1].items()) or "accum4" for c in LAYOUTS])
def test_the_loss_and_gradients_are_the_one_device_token_mean_under_every_layout(world, layout, micro):
    ref_loss, ref_grads = one_device(layout.get("tie_embeddings", False))
    moved, losses = {}, []
    for grads, loss, norm in run_ranks(world, _one_step, layout, micro, timeout=300):
        moved.update(grads)
        losses += [loss] if loss is not None else []
        assert torch.isfinite(torch.tensor(norm))
    assert moved.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        torch.testing.assert_close(moved[n], g, **TIGHT, msg=n)
    # Each rank reports its share; their mean (what the run log prints) is the token mean.
    assert sum(losses) / len(losses) == pytest.approx(ref_loss, rel=1e-12)


def test_a_batch_with_no_real_target_gives_zero_loss_and_zero_gradients_not_nan():
    moved, loss, norm = run_ranks(1, _all_ignored)[0]
    assert loss == 0.0 and norm == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in moved.values())


def _all_ignored(rank, world):
    import minipar.run.train as train

    cfg = TrainConfig(model="tiny", seq_len=SEQ, global_batch=ROWS, micro_batch=4, grad_clip=1.0, dtype="float64",
                      weight_decay=0.0)
    with Mesh.build() as mesh:
        model, _ = train.build_model(cfg, mesh, get_config("tiny", **MODEL), torch.device("cpu"), torch.float64)
        wrapper = grad_sync(model, mesh, cfg)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        x, y = batch()
        y[:] = -100
        loss, norm = train.train_step(wrapper, list(zip(x.split(4), y.split(4))), 1.0)
        return {n: before[n] - p.detach() for n, p in model.named_parameters()}, loss, norm
