"""Step 3: tensor parallelism, seen from every rank: who holds which slice, and what it costs.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/step_03_tensor_parallel.py    (4 works too)

All ranks form one tp group; everything is float64, and every result is compared with the same
computation on one device.

(a) one matmul Y = X A split by columns (ColumnParallelLinear) and by rows (RowParallelLinear),
    on small whole numbers: each rank's weight and output, and the ledger of forward and backward;
(b) the SwiGLU MLP of the tiny Llama: one all-reduce of b*s*h forward, one backward;
(c) the vocab-parallel cross-entropy: [b, s, V/tp] logits per rank, three all-reduces of one
    number per token, and a vocabulary of 251 that no tp divides (padded) with the same loss;
(d) the whole tiny model with and without sequence parallelism: bytes per forward+backward by op.

Chapter: docs/03_tensor_parallel.md.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minipar import collectives as C
from minipar import tensor_parallel as T
from minipar.mesh import Mesh
from minipar.model import Llama, get_config

B, S = 2, 8  # the token batch of (c) and (d)


def each_rank(title: str, line: str) -> None:
    """Gather one line from every rank; rank 0 prints them in rank order under the title."""
    lines = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(line, lines, dst=0)
    if dist.get_rank() == 0:
        print(title)
        print("\n".join(f"  rank {r}: {text}" for r, text in enumerate(lines)))


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args)


def ints(t: torch.Tensor) -> str:
    return str([[int(v) for v in row] for row in t.tolist()]).replace(" ", "")


def ledger_line(snap: dict) -> str:
    return ", ".join(f"{k} {v['calls']} call(s) {v['bytes']:,} B" for k, v in snap.items()) or "no collective"


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a - b).abs().max().item():.1e}"


def part_a(mesh: Mesh) -> None:
    g, tp, r = mesh.tp_group, mesh.tp_group.size, mesh.tp_group.rank
    X = (torch.arange(16, dtype=torch.float64).reshape(2, 8) % 5) - 2  # [2, 8]: 2 tokens, 8 features
    W = (torch.arange(64, dtype=torch.float64).reshape(8, 8) * 7 % 5) - 2  # [out, in]: A = W^T
    say(f"(a) Y = X A with X {list(X.shape)}, A = W^T, W {list(W.shape)} [out, in], tp = {tp}")
    say(f"  X = {ints(X)}\n  Y = X A (one device) = {ints(X @ W.T)}")

    col = T.ColumnParallelLinear(8, 8, g).double()
    with torch.no_grad():
        col.weight.copy_(T.shard(W, col.weight, g))  # rows of W = columns of A
    x = X.clone().requires_grad_()
    mesh.ledger.reset()
    y = col(T.enter_parallel_region(x, g, sequence_parallel=False))  # [2, 8/tp]
    fwd = mesh.ledger.snapshot()
    mesh.ledger.reset()
    y.sum().backward()  # each rank's piece of sum(Y); f all-reduces the input gradient
    bwd = mesh.ledger.snapshot()
    each_rank("  column-parallel: weight [out/tp, in], output = this rank's columns of Y",
              f"weight {list(col.weight.shape)}  Y[:, {r * 8 // tp}:{(r + 1) * 8 // tp}] = {ints(y.detach())}")
    full = T.gather_logits(y.detach(), g, 8)  # for display only
    say(f"  gathered {list(full.shape)} == X A: {torch.equal(full, X @ W.T)};  "
        f"dX == one device: {torch.equal(x.grad, torch.ones(2, 8, dtype=torch.float64) @ W)}")
    say(f"  ledger forward: {ledger_line(fwd)};  backward: {ledger_line(bwd)}")

    row = T.RowParallelLinear(8, 8, g).double()
    with torch.no_grad():
        row.weight.copy_(T.shard(W, row.weight, g))  # columns of W = rows of A
    x_local = X.chunk(tp, dim=-1)[r].clone().requires_grad_()  # [2, 8/tp]: the input arrives split
    partial = F.linear(x_local.detach(), row.weight.detach())  # what this rank adds before the all-reduce
    mesh.ledger.reset()
    y = row(x_local)  # [2, 8]
    fwd = mesh.ledger.snapshot()
    mesh.ledger.reset()
    y.sum().backward()  # every rank holds the whole Y, and the same gradient of it: nothing to send
    bwd = mesh.ledger.snapshot()
    each_rank("\n  row-parallel: input [.., in/tp], weight [out, in/tp], output = a partial sum of Y",
              f"X slice {ints(x_local.detach())}  weight {list(row.weight.shape)}  partial {ints(partial)}")
    say(f"  summed by all-reduce == X A: {torch.equal(y.detach(), X @ W.T)}")
    say(f"  ledger forward: {ledger_line(fwd)};  backward: {ledger_line(bwd)}")


def part_b(mesh: Mesh) -> None:
    g = mesh.tp_group
    mlp = Llama(get_config("tiny"), seed=0, tp_group=g).double().layers[0].mlp
    ref = Llama(get_config("tiny"), seed=0).double().layers[0].mlp  # tp_group=None: Group.solo
    gen = torch.Generator().manual_seed(3)
    x0, dy = torch.randn(2, 2, 4, 32, generator=gen, dtype=torch.float64)  # [b, s, h] each, same on every rank
    x, x_ref = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    mesh.ledger.reset()
    y = mlp(x)
    fwd = mesh.ledger.snapshot()
    mesh.ledger.reset()
    y.backward(dy)
    bwd = mesh.ledger.snapshot()
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    say(f"\n(b) SwiGLU MLP of the tiny Llama, layer 0: x [2, 4, 32] = b*s*h = {x0.numel()} elements, float64")
    say("  one device: " + "  ".join(f"{n} {list(p.shape)}" for n, p in ref.named_parameters()))
    shapes = "  ".join(f"{n} {list(p.shape)}" for n, p in mlp.named_parameters())
    sliced = all(torch.equal(p, T.shard(q, p, g)) for p, q in zip(mlp.parameters(), ref.parameters()))
    each_rank("  weights per rank (shard == slice of the single-device weight?)", f"{shapes}  {sliced}")
    each_rank("  forward and backward", f"ledger forward: {ledger_line(fwd)};  backward: {ledger_line(bwd)}")
    grad_diff = max(diff(p.grad, T.shard(q.grad, p, g)) for p, q in zip(mlp.parameters(), ref.parameters()))
    each_rank("  max |tp - one device|: output, input grad, weight grads (vs their slices)",
              f"{diff(y.detach(), y_ref.detach())}  {diff(x.grad, x_ref.grad)}  {grad_diff}")


def part_c(mesh: Mesh, vocab: int) -> None:
    g, tp = mesh.tp_group, mesh.tp_group.size
    cfg = get_config("tiny", vocab_size=vocab)
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, vocab, (B, S), generator=gen)
    y = torch.randint(0, vocab, (B, S), generator=gen)
    logits = Llama(cfg, seed=0, tp_group=g).double()(x).detach().requires_grad_()  # [b, s, V/tp]
    mesh.ledger.reset()
    loss = T.vocab_parallel_cross_entropy(logits, y, g, vocab)
    fwd = mesh.ledger.snapshot()
    mesh.ledger.reset()
    loss.backward()
    bwd = mesh.ledger.snapshot()

    full = T.gather_logits(logits.detach(), g, vocab).requires_grad_()  # [b, s, V]: for the check only
    ref = F.cross_entropy(full.flatten(0, 1), y.flatten())
    ref.backward()
    local = logits.shape[-1]
    pad = max(0, (g.rank + 1) * local - vocab)  # padding columns on this rank
    vocab_sharded = T.mark(torch.nn.Parameter(torch.empty(local)), (vocab,), dim=0)  # for T.shard
    full_grad_slice = T.shard(full.grad.transpose(0, -1), vocab_sharded, g).transpose(0, -1)  # zeros on padding
    say(f"\n(c) vocab-parallel cross-entropy, V = {vocab}, tp = {tp}: {tp * local} columns, {tp * local - vocab} padding")
    each_rank("  logits shard, its token ids, padding columns, loss",
              f"{list(logits.shape)} ids [{g.rank * local}, {(g.rank + 1) * local})  pad {pad}  "
              f"loss {loss.item():.12f}")
    say(f"  F.cross_entropy on the gathered [b, s, V] logits: {ref.item():.12f}  (|diff| {diff(loss, ref)})")
    each_rank("  grad of the logits shard vs slice of the full grad, (softmax - onehot)/N: max |diff|",
              diff(logits.grad, full_grad_slice))
    say(f"  ledger forward: {ledger_line(fwd)}  (= 3 x b*s*8 = 3 x {B * S * 8} B);  backward: {ledger_line(bwd)}")
    say(f"  largest logits on a rank: {list(logits.shape)}; the full [{B}, {S}, {vocab}] exists only in this check")


def part_d(mesh: Mesh) -> None:
    g = mesh.tp_group
    cfg = get_config("tiny")
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    y = torch.roll(x, -1, dims=1)
    ref = Llama(cfg, seed=0).double()
    ref_loss = ref(x, y)
    ref_loss.backward()
    bsh = B * S * cfg.dim * 8
    say(f"\n(d) the tiny Llama ({cfg.n_layers} layers), b={B} s={S} h={cfg.dim}: one [b, s, h] float64 = {bsh:,} B;"
        f" one forward + backward + sync_partial_grads")
    activation_sent = {}
    for sp in (False, True):
        model = Llama(cfg, seed=0, tp_group=g, sequence_parallel=sp).double()
        norm_input = []  # the shape of the activation in the norm/residual region
        model.layers[0].attn_norm.register_forward_hook(lambda m, i, o: norm_input.append(list(i[0].shape)))
        mesh.ledger.reset()
        loss = model(x, y)
        loss.backward()
        T.sync_partial_grads(model, g)
        snap = mesh.ledger.snapshot()
        grads = {n: T.unshard(p.grad, p, g) for n, p in model.named_parameters()}  # after the snapshot
        worst = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        say(f"\n  sequence_parallel={sp}     {'calls':>6}{'payload B':>11}{'sent B':>9}")
        for k, v in snap.items():
            say(f"    {k:<22}{v['calls']:>6}{v['bytes']:>11,}{v['sent']:>9,}")
        say(f"    {'total':<28}{sum(v['bytes'] for v in snap.values()):>11,}{sum(v['sent'] for v in snap.values()):>9,}")
        each_rank(f"  norm input, loss (one device {ref_loss.item():.12f}), max |grad - one device| over all params",
                  f"{norm_input[0]}  {loss.item():.12f}  {worst:.1e}")
        # The [b, s, h] traffic: all-reduces minus the loss's three, or the all-gathers + reduce-scatters.
        loss_sent = 3 * C.ring_bytes_sent("all_reduce", B * S * 8, g.size)
        activation_sent[sp] = (snap["tp/all_gather"]["sent"] + snap["tp/reduce_scatter"]["sent"] if sp
                               else snap["tp/all_reduce"]["sent"] - loss_sent)
    say(f"\n  bytes sent for the [b, s, h] activations: all-reduce {activation_sent[False]:,}, "
        f"all-gather + reduce-scatter {activation_sent[True]:,}")


def main() -> None:
    torch.set_num_threads(1)  # several ranks share a few CPU cores
    dist.init_process_group("gloo")
    mesh = Mesh.build(tp=dist.get_world_size())
    part_a(mesh)
    part_b(mesh)
    part_c(mesh, 256)
    part_c(mesh, 251)
    part_d(mesh)
    mesh.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
