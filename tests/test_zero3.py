"""ZeRO-3: equal to one device and to PyTorch's FSDP2; 1/N of the weights outside the layer in use;
3 Psi (N-1)/N bytes per step."""

from collections import Counter

import pytest
import torch
from harness import parallel_llama, run_ranks, run_ranks_once, tiers
from test_data_parallel import GLOBAL_BATCH, OPT, STEPS, global_batch, new_model, single_device_params

from minipar.collectives import ring_bytes_sent
from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw, parallelize
from minipar.run.train import train_step
from minipar.tensor_parallel import unshard
from minipar.zero3 import Transport, Zero3DataParallel, units_of

TIGHT = dict(rtol=1e-10, atol=1e-12)


def zero3(model, groups):
    return Zero3DataParallel(model, groups, lambda pgs: adamw(pgs, OPT.lr), param_groups(model, OPT))


def _run(rank, world, accum, with_fsdp):
    with Mesh.build(dp=world) as mesh:
        model = new_model()
        z = zero3(model, mesh.groups())
        full_bytes = sum(b.padded for b in z.buckets) * 8
        per = GLOBAL_BATCH // world
        ledgers, between = [], []
        for step in range(STEPS):
            x, y = global_batch(step)
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            mesh.ledger.reset()
            train_step(z, list(zip(x.chunk(accum), y.chunk(accum))), grad_clip=1.0)
            ledgers.append({k: v["sent"] for k, v in mesh.ledger.snapshot().items()})
            between.append(z.param_bytes())
        # The layer in use: during a forward, at most two units (this one and the prefetched next)
        # are whole.
        peaks = []
        for unit in units_of(model):
            unit.register_forward_hook(lambda *a: peaks.append(sum(b.full.untyped_storage().nbytes()
                                                                   for b in z.buckets)))
        with torch.no_grad():
            model(*global_batch(0))
        with z.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        fsdp = fsdp_params(mesh, accum, world, rank) if with_fsdp else None
        return dict(params=params, fsdp=fsdp, ledgers=ledgers, between=between, full_bytes=full_bytes,
                    masters=sum(b.master.numel() * 8 for b in z.buckets), peaks=peaks,
                    largest_unit=max(sum(b.padded * 8 for b in unit) for unit in z._unit_buckets))


def fsdp_params(mesh, accum, world, rank):
    """PyTorch's FSDP2 (fully_shard) on the same data, one unit per transformer layer."""
    from torch.distributed.fsdp import fully_shard

    device_mesh = torch.distributed.device_mesh.DeviceMesh.from_group(mesh.groups().dp.pg, "cpu")
    model = new_model()
    for layer in model.layers.values():
        fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    opt = adamw(param_groups(model, OPT), OPT.lr)
    per = GLOBAL_BATCH // world
    for step in range(STEPS):
        x, y = global_batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for mx, my in zip(x.chunk(accum), y.chunk(accum)):
            (model(mx, my) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world,accum", tiers([(2, 1), (2, 2), (4, 1), (4, 2)], fast=1))  # with FSDP2
def test_zero3_params_after_adamw_steps_equal_single_device_and_fsdp2(world, accum):
    reference = single_device_params()
    for r in run_ranks_once(world, _run, accum, accum == 2 and world == 2):
        for name, ref in reference.items():
            torch.testing.assert_close(r["params"][name], ref, **TIGHT, msg=name)
            if r["fsdp"] is not None:
                torch.testing.assert_close(r["params"][name], r["fsdp"][name], **TIGHT, msg=name)


@pytest.mark.parametrize("world", tiers([2, 4], fast=1))
def test_zero3_holds_a_slice_of_the_weights_and_sends_three_psi(world):
    for r in run_ranks_once(world, _run, 1, False):
        # Between steps: no whole weights at all, only this rank's master slices (1/N of Psi).
        assert all(b == r["masters"] == r["full_bytes"] // world for b in r["between"])
        # During forward: at most the layer in use and the prefetched next one are whole.
        assert max(r["peaks"]) <= 2 * r["largest_unit"] < r["full_bytes"]
        for sent in r["ledgers"]:
            ag, rs = sent["dp/all_gather"], sent["dp/reduce_scatter"]
            one_psi = (world - 1) * r["full_bytes"] // world
            assert ag == 2 * one_psi and rs == one_psi  # forward and backward gathers, one reduce-scatter
            assert sent["dp/all_reduce"] == 2 * ring_bytes_sent("all_reduce", 8, world)  # target count, norm


def _zero3_tp(rank, world):
    with Mesh.build(dp=2, tp=2) as mesh:
        cfg = get_config("tiny", vocab_size=250)
        model = parallel_llama(cfg, seed=5, tp_group=mesh.groups().tp, sequence_parallel=True).double()
        z = zero3(model, mesh.groups())
        for step in range(2):
            x = torch.randint(0, 250, (4, 8), generator=torch.Generator().manual_seed(step))
            y = torch.roll(x, -1, dims=1)
            rows = slice(mesh.coord("dp") * 2, mesh.coord("dp") * 2 + 2)
            train_step(z, [(x[rows], y[rows])], 0.5)
        with z.gathered():  # copies: the gathered weights are freed again when the block ends
            return {n: unshard(p.detach(), p, mesh.groups().tp).clone() for n, p in model.named_parameters()}


def test_zero3_with_tp2_and_sequence_parallel_equals_single_device():
    cfg = get_config("tiny", vocab_size=250)
    model = Llama(cfg, seed=5).double()
    opt = adamw(param_groups(model, OPT), OPT.lr)
    for step in range(2):
        x = torch.randint(0, 250, (4, 8), generator=torch.Generator().manual_seed(step))
        model(x, torch.roll(x, -1, dims=1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    for r in run_ranks(4, _zero3_tp):
        for n, p in model.named_parameters():
            torch.testing.assert_close(r[n], p.detach(), **TIGHT, msg=n)


# ZeRO-3 with activation recompute: each layer's forward runs again inside its backward.


class CountingTransport(Transport):
    """The plain transport, counting the gathers each bucket sends, forward and backward."""

    def __init__(self):
        self.sent = Counter()

    def gather_forward(self, bucket):
        self.sent[id(bucket), "forward"] += 1
        return super().gather_forward(bucket)

    def gather_backward(self, bucket):
        self.sent[id(bucket), "backward"] += 1
        return super().gather_backward(bucket)


def _zero3_recompute(rank, world, accum, recompute=True, selective=False):
    """STEPS AdamW steps of ZeRO-3 over `world` ranks, each layer recomputed (selective: its cheap ops
    only, --recompute-selective): per step the loss, the
    gradient norm, this rank's gradient slices (by the names of their parameters) and the ledger;
    the weights after; at every call of a layer's attention, the forward and backward gathers its
    layer had sent by then and whether its weights were whole."""
    with Mesh.build(dp=world) as mesh:
        model = parallelize(new_model(), recompute=recompute and not selective, recompute_selective=selective)
        transport, name_of = CountingTransport(), {id(p): n for n, p in model.named_parameters()}
        z = Zero3DataParallel(model, mesh.groups(), lambda pgs: adamw(pgs, OPT.lr), param_groups(model, OPT),
                              transport=transport)
        layers = [(unit, buckets) for unit, buckets in zip(z._units, z._unit_buckets) if hasattr(unit, "attn")]
        calls = {i: [] for i in range(len(layers))}
        for i, (unit, buckets) in enumerate(layers):
            def seen(*_, i=i, buckets=buckets):  # each of the layer's buckets is gathered as often
                sent = [transport.sent[id(buckets[0]), phase] for phase in ("forward", "backward")]
                calls[i].append((*sent, all(b.full.untyped_storage().nbytes() > 0 for b in buckets)))
            unit.attn.register_forward_pre_hook(seen)
        grads, finish = [], z.finish_grad_sync

        def finish_and_keep():  # train_step's sync, then the slices the optimizer is about to use
            finish()
            grads.append([([name_of[id(p)] for p in b.params], b.padded, b.slice, b.grad_slice.clone())
                          for b in z.buckets])
        z.finish_grad_sync = finish_and_keep
        per, steps, ledgers = GLOBAL_BATCH // world, [], []
        for step in range(STEPS):
            x, y = global_batch(step)
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            mesh.ledger.reset()
            steps.append(train_step(z, list(zip(x.chunk(accum), y.chunk(accum))), grad_clip=1.0))
            ledgers.append({k: v["sent"] for k, v in mesh.ledger.snapshot().items()})
        with z.gathered():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        return dict(steps=steps, grads=grads, ledgers=ledgers, params=params, calls=calls,
                    full_bytes=sum(b.padded for b in z.buckets) * 8)


def single_device_steps():
    """The plain model on the whole global batch: per step the loss, the gradient norm and the
    gradients (before clipping); the weights after."""
    model = new_model()
    opt = adamw(param_groups(model, OPT), OPT.lr)
    losses, norms, grads = [], [], []
    for step in range(STEPS):
        loss = model(*global_batch(step))
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, grads, {n: p.detach() for n, p in model.named_parameters()}


RECOMPUTES = [(2, 1, False), (2, 2, False), (4, 1, False), (4, 2, False), (2, 2, True), (4, 1, True)]


@pytest.mark.parametrize("world,accum,selective", tiers(RECOMPUTES, fast=[1, 4]))
def test_zero3_with_recompute_equals_single_device_losses_gradients_and_weights(world, accum, selective):
    losses, norms, grads, params = single_device_steps()
    ranks = run_ranks_once(world, _zero3_recompute, accum, True, selective)
    for step in range(STEPS):  # each rank's loss is its tokens' sum over (count / N): their mean is the loss
        assert sum(r["steps"][step][0] for r in ranks) / world == pytest.approx(losses[step], rel=1e-12)
    for r in ranks:
        assert [norm for _, norm in r["steps"]] == pytest.approx(norms, rel=1e-10)  # the whole gradient's norm
        for step in range(STEPS):  # this rank's slice of each bucket's flat gradient, as one device has it
            for names, padded, mine, grad_slice in r["grads"][step]:
                flat = torch.cat([grads[step][n].reshape(-1) for n in names])
                flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
                torch.testing.assert_close(grad_slice, flat[mine], **TIGHT, msg=str(names))
        for name, ref in params.items():
            torch.testing.assert_close(r["params"][name], ref, **TIGHT, msg=name)


@pytest.mark.parametrize("world,accum,selective", tiers(RECOMPUTES, fast=[1, 4]))
def test_zero3_with_recompute_gathers_each_layer_once_for_its_replay_and_backward(world, accum, selective):
    for r in run_ranks_once(world, _zero3_recompute, accum, True, selective):
        # A layer's attention runs twice in the k-th micro-batch of the run (from 1): in forward,
        # after its k-th forward gather (k - 1 backward ones); then in the replay, inside the layer's
        # backward, after its k-th backward gather, the one its output's hook started. Both times
        # on whole weights.
        for calls in r["calls"].values():
            assert calls == [c for k in range(1, STEPS * accum + 1) for c in ((k, k - 1, True), (k, k, True))]
        # So the ledger is ZeRO-3's without recompute: per micro-batch a forward and a backward
        # all-gather of every bucket and a reduce-scatter of its gradients, (N-1)/N Psi each
        # (Psi: all padded buckets, 8 bytes a number); the replay adds nothing. Per step, one
        # 8-byte all-reduce of the target count and one of the norm's squares.
        one_psi = (world - 1) * r["full_bytes"] // world
        for sent in r["ledgers"]:
            assert sent == {"dp/all_gather": 2 * accum * one_psi, "dp/reduce_scatter": accum * one_psi,
                            "dp/all_reduce": 2 * ring_bytes_sent("all_reduce", 8, world)}
