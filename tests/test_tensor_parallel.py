"""Tensor parallelism: every layer, the loss and the whole model equal the single-device ones."""

import pytest
import torch
import torch.nn.functional as F
from harness import parallel_llama, run_ranks, tiers

from minipar import tensor_parallel as T
from minipar.collectives import Group
from minipar.data_parallel import DataParallel, clip_grads, optimizer_state, param_groups, set_optimizer_state
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw
from minipar.placement import placement_of
from minipar.run.config import TrainConfig
from minipar.run.train import train_step

TIGHT = dict(rtol=1e-10, atol=1e-12)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def close(a, b, what):
    torch.testing.assert_close(a, b, **TIGHT, msg=what)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


def _layers(rank, world):
    with Mesh.build(tp=world) as mesh:
        g = mesh.groups().tp
        x, dy = randn(2, 5, 8, seed=1), randn(2, 5, 12, seed=2)

        # Column-parallel: weight split by output features; input replicated (f, inside the layer).
        w, b = randn(12, 8, seed=3), randn(12, seed=4)
        col = T.ColumnParallelLinear(8, 12, g, bias=True).double()
        with torch.no_grad():
            col.weight.copy_(T.shard(w, col.weight, g))
            col.bias.copy_(T.shard(b, col.bias, g))
        xs = x.clone().requires_grad_()
        y = col(xs)
        y.backward(T.shard(dy.transpose(0, -1), col.bias, g).transpose(0, -1))  # this rank's columns of dY
        ref_x = x.clone().requires_grad_()
        ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
        ref = F.linear(ref_x, ref_w, ref_b)
        ref.backward(dy)
        close(T.gather_logits(y, g, 12), ref, "column output")
        close(xs.grad, ref_x.grad, "column input grad")
        close(col.weight.grad, T.shard(ref_w.grad, col.weight, g), "column weight grad")
        close(col.bias.grad, T.shard(ref_b.grad, col.bias, g), "column bias grad")

        # Row-parallel: weight split by input features; input already split; partial sums added (g).
        w, b = randn(12, 8, seed=5), randn(12, seed=6)
        row = T.RowParallelLinear(8, 12, g, bias=True).double()
        with torch.no_grad():
            row.weight.copy_(T.shard(w, row.weight, g))
            row.bias.copy_(b)
        x_local = x.chunk(world, dim=-1)[g.rank].clone().requires_grad_()
        y = row(x_local)
        y.backward(dy)
        ref_x, ref_w, ref_b = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        F.linear(ref_x, ref_w, ref_b).backward(dy)
        close(y, F.linear(x, w, b), "row output")
        close(x_local.grad, ref_x.grad.chunk(world, dim=-1)[g.rank], "row input grad")
        close(row.weight.grad, T.shard(ref_w.grad, row.weight, g), "row weight grad")
        close(row.bias.grad, ref_b.grad, "row bias grad")

        # Vocab-parallel embedding, with a vocabulary of 10 (padded to 12 at tp=4).
        table = randn(10, 8, seed=7)
        emb = T.VocabParallelEmbedding(10, 8, g).double()
        with torch.no_grad():
            emb.weight.copy_(T.shard(table, emb.weight, g))
        ids = torch.tensor([[0, 9, 3, 3, 7], [5, 1, 8, 2, 6]])
        out = emb(ids)
        out.backward(dy[..., :8])
        ref_table = table.clone().requires_grad_()
        F.embedding(ids, ref_table).backward(dy[..., :8])
        close(out, F.embedding(ids, table), "embedding output")
        close(emb.weight.grad, T.shard(ref_table.grad, emb.weight, g), "embedding grad")
        return emb.weight.shape[0]


@pytest.mark.parametrize("tp", tiers([1, 2, 4], fast=2))
def test_column_row_and_embedding_equal_single_device_outputs_and_grads(tp):
    rows = run_ranks(tp, _layers)
    assert rows == [-(-10 // tp)] * tp  # ceil(V / tp) rows each, padding included


def _cross_entropy(rank, world, vocab):
    with Mesh.build(tp=world) as mesh:
        g = mesh.groups().tp
        logits = randn(2, 6, vocab, seed=11) * 3
        targets = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(12))
        targets[0, 1] = targets[1, 4] = -100  # ignored positions
        local = torch.nn.Parameter(T.shard(logits.transpose(0, -1), mark_vocab(vocab, world), g).transpose(0, -1))
        loss = T.vocab_parallel_cross_entropy(local, targets, g, vocab)
        loss.backward()
        ref_logits = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        ref.backward()
        close(loss, ref, "loss")
        expected = T.shard(ref_logits.grad.transpose(0, -1), mark_vocab(vocab, world), g).transpose(0, -1)
        close(local.grad, expected, "logit grads (zero on padding)")
        return local.shape[-1]


def mark_vocab(vocab, tp):
    """A stand-in parameter with the sharding of a vocabulary-parallel dimension."""
    return T.mark(torch.nn.Parameter(torch.empty(-(-vocab // tp))), (vocab,), dim=0)


@pytest.mark.parametrize("tp,vocab", tiers([(1, 10), (2, 10), (4, 10), (4, 16)], fast=2))
def test_vocab_parallel_cross_entropy_equals_torch_with_ignore_index_and_padding(tp, vocab):
    assert run_ranks(tp, _cross_entropy, vocab) == [-(-vocab // tp)] * tp


# ----------------------------------------------------------------------------------------------
# The whole model
# ----------------------------------------------------------------------------------------------

B, S = 2, 8


def batch(seed=0, vocab=256):
    x = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))
    return x, torch.roll(x, -1, dims=1)


def gqa_config():
    # 4 query heads, 2 kv heads: tp=2 splits the kv heads, tp=4 must replicate them.
    # A vocabulary of 250 is not divisible by 4: padding is exercised too.
    return get_config("tiny", vocab_size=250)


def reference_model():
    model = Llama(gqa_config(), seed=5).double()
    x, y = batch(vocab=250)
    logits = model(x)
    loss = model(x, y)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _whole_model(rank, world, sp):
    with Mesh.build(tp=world) as mesh:
        g = mesh.groups().tp
        model = parallel_llama(gqa_config(), seed=5, tp_group=g, sequence_parallel=sp).double()
        x, y = batch(vocab=250)
        logits = T.gather_logits(model(x), g, 250)
        mesh.ledger.reset()
        saved, weights = [], {p.data_ptr() for p in model.parameters()}

        def note(t):  # sizes of the activations autograd keeps for backward (not the weights)
            if t.data_ptr() not in weights:
                saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
            loss = model(x, y)
        forward = mesh.ledger.snapshot()
        mesh.ledger.reset()
        loss.backward()
        backward = mesh.ledger.snapshot()
        T.sync_partial_grads(model, g)
        grads = {n: T.unshard(p.grad, p, g) for n, p in model.named_parameters()}
        return dict(logits=logits.detach(), loss=loss.detach(), grads=grads, forward=forward, backward=backward,
                    largest_saved=max(saved), local_vocab=model.lm_head.weight.shape[0])


@pytest.mark.parametrize("tp,sp", tiers([(2, False), (4, False), (2, True), (4, True)], fast=3))
def test_model_logits_loss_and_every_grad_equal_single_device(tp, sp):
    ref_logits, ref_loss, ref_grads = reference_model()
    for r in run_ranks(tp, _whole_model, sp):
        close(r["logits"], ref_logits, "logits")
        close(r["loss"], ref_loss, "loss")
        assert r["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            close(r["grads"][name], grad, name)


@pytest.mark.parametrize("tp,sp", tiers([(2, False), (4, False), (2, True), (4, True)], fast=3))
def test_ledger_two_collectives_per_layer_each_way_and_no_full_logits(tp, sp):
    cfg = gqa_config()
    bsh = B * S * cfg.dim * 8  # bytes of one [b, s, h] float64 activation
    for r in run_ranks(tp, _whole_model, sp):
        fwd, bwd = r["forward"], r["backward"]
        if not sp:
            # Forward: g after wo and after w_down in each layer, plus the embedding's sum.
            assert fwd["tp/all_reduce"]["calls"] - 3 == 2 * cfg.n_layers + 1  # 3: the loss's max, sum, target
            assert fwd["tp/all_reduce"]["bytes"] - 3 * B * S * 8 == (2 * cfg.n_layers + 1) * bsh
            # Backward: f before attention and before the MLP in each layer, plus the LM head's input.
            sent = 2 * (tp - 1) * (2 * cfg.n_layers + 1) * bsh // tp
            assert bwd["tp/all_reduce"] == {"calls": 2 * cfg.n_layers + 1, "bytes": (2 * cfg.n_layers + 1) * bsh,
                                            "sent": sent, "intra": sent, "cross": 0}  # one node
            assert "tp/all_gather" not in fwd and "tp/reduce_scatter" not in fwd
        else:
            # The same regions, as all-gathers (entering) and reduce-scatters (leaving): same bytes.
            n, sent = 2 * cfg.n_layers + 1, (tp - 1) * (2 * cfg.n_layers + 1) * bsh // tp
            one_node = {"calls": n, "bytes": n * bsh, "sent": sent, "intra": sent, "cross": 0}
            assert fwd["tp/all_gather"] == one_node and fwd["tp/reduce_scatter"] == one_node
            assert bwd["tp/all_gather"] == fwd["tp/reduce_scatter"]
            assert bwd["tp/reduce_scatter"] == fwd["tp/all_gather"]
            assert fwd["tp/all_reduce"]["calls"] == 3  # only the loss's three numbers per token
        # The [b, s, V] logits never exist: the LM head holds V/tp rows, and the largest activation
        # kept for backward is the [b, s, V/tp] shard.
        local_v = -(-cfg.vocab_size // tp)
        assert r["local_vocab"] == local_v
        assert r["largest_saved"] == B * S * local_v  # the logits shard is the largest activation


def _tp_messages(rank, world, sp, n_layers):
    """The tp ledger's calls by op for one forward and backward, then the partial-gradient sync."""
    with Mesh.build(tp=world) as mesh:
        cfg = get_config("tiny", vocab_size=250, n_layers=n_layers)
        model = parallel_llama(cfg, seed=5, tp_group=mesh.groups().tp, sequence_parallel=sp).double()
        mesh.ledger.reset()
        model(*batch(vocab=250)).backward()
        T.sync_partial_grads(model, mesh.groups().tp)
        return {op: e.calls for (group, op), e in mesh.ledger.entries.items() if group == "tp"}


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("n_layers", tiers([1, 3], fast=1))
def test_a_step_at_tp2_enters_and_leaves_each_region_once_each_way(sp, n_layers):
    # A layer has two regions, attention and MLP, each entered once (f: one message for q, k, v
    # and one for gate and up, not one per projection) and left once (g, in wo and w_down).
    # Without sp, g all-reduces forward and f backward: 4 all-reduces per layer. Outside the
    # layers: the embedding's g, the LM head's f, the loss's max, sum of exponentials and target
    # logit: 5. With sp, f is an all-gather forward and a reduce-scatter backward, g the reverse:
    # per layer 4 of each; outside, the embedding's g and the head's f give 2 of each, and the
    # all-reduces are the loss's 3 and the sync of the norms' partial gradients.
    expected = ({"all_gather": 4 * n_layers + 2, "reduce_scatter": 4 * n_layers + 2, "all_reduce": 3 + 1} if sp
                else {"all_reduce": 4 * n_layers + 5})
    for calls in run_ranks(2, _tp_messages, sp, n_layers):
        assert calls == expected


# ----------------------------------------------------------------------------------------------
# Training: dp2 x tp2 equals one device
# ----------------------------------------------------------------------------------------------

STEPS, GLOBAL_BATCH = 3, 4
OPT = TrainConfig(lr=1e-2, weight_decay=0.1)


def global_batch(step):
    x = torch.randint(0, 250, (GLOBAL_BATCH, S), generator=torch.Generator().manual_seed(100 + step))
    return x, torch.roll(x, -1, dims=1)


def single_device_training():
    model = Llama(gqa_config(), seed=5).double()
    opt = adamw(param_groups(model, OPT), OPT.lr)
    for step in range(STEPS):
        model(*global_batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _dp_tp_training(rank, world, sp):
    with Mesh.build(dp=2, tp=world // 2) as mesh:
        model = parallel_llama(gqa_config(), seed=5, tp_group=mesh.groups().tp, sequence_parallel=sp).double()
        dp_model = DataParallel(model, mesh.groups(), optimizer=adamw(param_groups(model, OPT), OPT.lr))
        per = GLOBAL_BATCH // 2
        for step in range(STEPS):
            x, y = global_batch(step)
            mine = slice(mesh.coord("dp") * per, (mesh.coord("dp") + 1) * per)
            x, y = x[mine], y[mine]
            train_step(dp_model, list(zip(x.chunk(2), y.chunk(2))), 0.5)
        return {n: T.unshard(p.detach(), p, mesh.groups().tp) for n, p in model.named_parameters()}


@pytest.mark.parametrize("sp", tiers([False, True], fast=1))
def test_dp2_tp2_training_steps_equal_single_device(sp):
    ref = single_device_training()
    for params in run_ranks(4, _dp_tp_training, sp):
        for name, p in ref.items():
            close(params[name], p, name)


def _clip(rank, world):
    with Mesh.build(tp=world) as mesh:
        model = parallel_llama(gqa_config(), seed=5, tp_group=mesh.groups().tp).double()
        model(*batch(vocab=250)).backward()
        T.sync_partial_grads(model, mesh.groups().tp)
        params = list(model.parameters())
        return clip_grads([p.grad for p in params], [(mesh.groups().tp,) * (placement_of(p).dim_of("tp") is not None)
                                                     for p in params], 0.0)


def test_grad_norm_counts_each_shard_once_and_replicas_once():
    model = Llama(gqa_config(), seed=5).double()
    model(*batch(vocab=250)).backward()
    ref = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    for norm in run_ranks(4, _clip):
        assert norm == pytest.approx(ref, rel=1e-12)


# ----------------------------------------------------------------------------------------------
# Layouts that cannot work
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,msg", [
    (dict(n_heads=6, n_kv_heads=2, dim=48, ffn_dim=64, tp=4), "does not divide the model's 6 attention heads"),
    (dict(n_heads=12, n_kv_heads=3, dim=48, ffn_dim=64, tp=4), "one must divide the other"),
    (dict(n_heads=4, n_kv_heads=2, dim=32, ffn_dim=66, tp=4), "MLP size 66"),
    (dict(n_heads=4, n_kv_heads=2, dim=32, ffn_dim=64, tp=1, sequence_parallel=True), "--sp needs --tp > 1"),
    (dict(n_heads=4, n_kv_heads=2, dim=32, ffn_dim=64, tp=4, sequence_parallel=True, seq_len=10), "10 tokens"),
    # with cp, a rank's share of the sequence: the one rule (context_parallel cuts it)
    (dict(n_heads=4, n_kv_heads=2, dim=32, ffn_dim=64, tp=4, sequence_parallel=True, seq_len=36, cp=2),
     r"18 tokens \(--seq-len 36 / --cp 2\) do not split over --tp 4: choose a --seq-len divisible by 8"),
])
def test_bad_tp_layouts_are_refused_with_the_fix(kw, msg):
    kw = dict(sequence_parallel=False, seq_len=16) | kw
    with pytest.raises(ValueError, match=msg):
        T.check_tensor_layout(**kw)


def test_solo_group_has_one_rank_at_index_zero_and_row_layer_checks_its_split():
    assert Group.solo("tp").size == 1 and Group.solo("tp").rank == 0
    with pytest.raises(ValueError, match="10 input features do not split"):
        T.RowParallelLinear(10, 4, Group("tp", None, [0, 1, 2, 3], None))


def _save_at_tp(rank, world, out):
    from minipar.ops import run_folder
    from minipar.run import checkpoint

    with Mesh.build(tp=world) as mesh:
        model = parallel_llama(gqa_config(), seed=5, tp_group=mesh.groups().tp).double()
        opt = adamw(param_groups(model, OPT), OPT.lr)
        dp_model = DataParallel(model, mesh.groups(), optimizer=opt)
        train_step(dp_model, [batch(vocab=250)], 1.0)
        full = checkpoint.gather_full(model, optimizer_state(model, opt), checkpoint.hyper_params(opt), mesh.groups())
        if rank == 0:
            checkpoint.save(out, 1, *full, {"step": 1, "consumed": 0})
        # and load it back at this layout: every shard returns exactly
        fresh = parallel_llama(gqa_config(), seed=9, tp_group=mesh.groups().tp).double()
        fresh_opt = adamw(param_groups(fresh, OPT), OPT.lr)
        torch.distributed.barrier()
        _, states = checkpoint.load(run_folder.resolve(out), fresh, mesh.groups())
        set_optimizer_state(fresh, fresh_opt, states)
        for p, q in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(p, q)
            assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
        return {n: T.unshard(p.detach(), p, mesh.groups().tp) for n, p in model.named_parameters()}


def test_checkpoint_written_at_tp4_loads_at_tp1_and_back(tmp_path):
    from minipar.ops import run_folder
    from minipar.run import checkpoint

    params = run_ranks(4, _save_at_tp, tmp_path)[0]
    single = Llama(gqa_config(), seed=0).double()
    checkpoint.load(run_folder.resolve(tmp_path), single)
    for n, p in single.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
    assert single.lm_head.weight.shape == (250, 32)  # stored without the padding rows
