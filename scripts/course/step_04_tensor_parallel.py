"""Step 4: tensor parallelism, seen from every rank: who holds which slice, and what it costs.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/course/step_04_tensor_parallel.py    (4 works too)

All ranks form one tp group; everything is float64 and compared with one device; the mesh's
ledger, reset around each piece, says which collectives it ran.

(a) Y = X A on whole numbers, A split by columns (each rank: some columns of Y) and by rows (each
    rank: a partial sum of Y);
(b) the tiny Llama's SwiGLU MLP: shards are slices of the one-device weights; one all-reduce of
    b*s*h forward, one backward;
(c) vocab-parallel cross-entropy: [b, s, V/tp] logits per rank, three all-reduces of one number per
    token; V = 251, which no tp divides, is padded and gives the same loss;
(d) the whole model without and with sequence parallelism: bytes by op (the same bytes sent),
    the partial gradients synchronised after, the single-device loss.

Chapter: docs/04_tensor_parallel.md.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import each_rank, finish, leave, say, start_gloo

from minipar import tensor_parallel as T
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import parallelize
from minipar.placement import placement_of

B, S = 2, 8  # the token batch of (c) and (d)


def counted(mesh: Mesh, fn, *args):
    """Run fn(*args); return its result and the ledger entries of exactly that run."""
    mesh.ledger.reset()
    out = fn(*args)
    return out, mesh.ledger.snapshot()


def calls(snap: dict) -> str:
    return ", ".join(f"{k} {v['calls']} call(s) {v['bytes']:,} B" for k, v in snap.items()) or "no collective"


def ints(t: torch.Tensor) -> str:
    return str([[int(v) for v in row] for row in t.tolist()]).replace(" ", "")


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a - b).abs().max().item():.1e}"


def part_a(mesh: Mesh) -> None:
    g, tp, r = mesh.groups().tp, mesh.groups().tp.size, mesh.groups().tp.rank
    X = torch.arange(16, dtype=torch.float64).reshape(2, 8) % 5 - 2  # [2, 8]: 2 tokens, 8 features
    W = torch.arange(64, dtype=torch.float64).reshape(8, 8) * 7 % 5 - 2  # [out, in]: A = W^T
    say(f"(a) Y = X A, X {list(X.shape)}, A = W^T with W {list(W.shape)} [out, in] as nn.Linear keeps it; tp = {tp}")
    say(f"  X = {ints(X)}\n  Y = X A on one device = {ints(X @ W.T)}")

    col = T.ColumnParallelLinear(8, 8, g).double()
    with torch.no_grad():
        col.weight.copy_(T.shard(W, col.weight, g))  # rows of W = columns of A
    x = X.clone().requires_grad_()
    y, fwd = counted(mesh, lambda: col(x))  # [2, 8/tp]; the layer enters the parallel region itself (f)
    _, bwd = counted(mesh, lambda: y.sum().backward())  # f: the input gradient is all-reduced
    each_rank("\n  column-parallel: weight [out/tp, in], output = this rank's columns of Y",
              f"weight {list(col.weight.shape)}  Y[:, {r * 8 // tp}:{(r + 1) * 8 // tp}] = {ints(y.detach())}")
    full = T.gather_logits(y.detach(), g, 8)  # for display only
    dX = torch.ones(2, 8, dtype=torch.float64) @ W  # d sum(X A) / dX on one device
    say(f"  gathered {list(full.shape)} == X A: {torch.equal(full, X @ W.T)};  "
        f"dX == one device: {torch.equal(x.grad, dX)}")
    say(f"  ledger forward: {calls(fwd)};  backward: {calls(bwd)}")

    row = T.RowParallelLinear(8, 8, g).double()
    with torch.no_grad():
        row.weight.copy_(T.shard(W, row.weight, g))  # columns of W = rows of A
    x_local = X.chunk(tp, dim=-1)[r].clone().requires_grad_()  # [2, 8/tp]: the input arrives split
    partial = F.linear(x_local.detach(), row.weight.detach())  # [2, 8]: what this rank adds to the sum
    y, fwd = counted(mesh, lambda: row(x_local))  # g: the partial sums are all-reduced
    _, bwd = counted(mesh, lambda: y.sum().backward())  # every rank has all of Y and its gradient
    each_rank("\n  row-parallel: X slice [2, in/tp], weight [out, in/tp], output = a partial sum of Y",
              f"X slice {ints(x_local.detach())}  weight {list(row.weight.shape)}  partial {ints(partial)}")
    say(f"  summed by the all-reduce == X A: {torch.equal(y.detach(), X @ W.T)}")
    say(f"  ledger forward: {calls(fwd)};  backward: {calls(bwd)}")


def part_b(mesh: Mesh) -> None:
    g = mesh.groups().tp
    mlp = parallelize(Llama(get_config("tiny"), seed=0), tp=g).double().get_submodule("layers.0.mlp")
    ref = Llama(get_config("tiny"), seed=0).double().get_submodule("layers.0.mlp")  # the plain model: one device
    x0, dy = torch.randn(2, 2, 4, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # [b, s, h]
    x, x_ref = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    y, fwd = counted(mesh, lambda: mlp(x))
    _, bwd = counted(mesh, lambda: y.backward(dy))
    y_ref = ref(x_ref)
    y_ref.backward(dy)
    say(f"\n(b) SwiGLU MLP, layer 0 of the tiny Llama; x [2, 4, 32]: b*s*h = {x0.numel()} float64 "
        f"= {x0.numel() * 8:,} B")
    say("  one device: " + "  ".join(f"{n} {list(p.shape)}" for n, p in ref.named_parameters()))
    shapes = "  ".join(f"{n} {list(p.shape)}" for n, p in mlp.named_parameters())
    sliced = all(torch.equal(p, T.shard(q, p, g)) for p, q in zip(mlp.parameters(), ref.parameters()))
    each_rank("  weights per rank; each == its slice of the one-device weight?", f"{shapes}  {sliced}")
    each_rank("  ledger", f"forward: {calls(fwd)};  backward: {calls(bwd)}")
    grad_diff = max(diff(p.grad, T.shard(q.grad, p, g)) for p, q in zip(mlp.parameters(), ref.parameters()))
    each_rank("  max |tp - one device|: output, input grad, weight grads (vs their slices)",
              f"{diff(y.detach(), y_ref.detach())}  {diff(x.grad, x_ref.grad)}  {grad_diff}")


def part_c(mesh: Mesh, vocab: int) -> None:
    g, tp = mesh.groups().tp, mesh.groups().tp.size
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, vocab, (2, B, S), generator=gen)  # tokens and (random) targets
    logits = parallelize(Llama(get_config("tiny", vocab_size=vocab), seed=0), tp=g).double()(x)  # [b, s, V/tp]
    logits = logits.detach().requires_grad_()
    loss, fwd = counted(mesh, lambda: T.vocab_parallel_cross_entropy(logits, y, g, vocab))
    _, bwd = counted(mesh, lambda: loss.backward())
    full = T.gather_logits(logits.detach(), g, vocab).requires_grad_()  # [b, s, V]: for this check only
    ref = F.cross_entropy(full.flatten(0, 1), y.flatten())
    ref.backward()
    local = logits.shape[-1]
    vocab_dim = T.mark(torch.nn.Parameter(torch.empty(local)), (vocab,), dim=0)  # tells T.shard the split
    grad_slice = T.shard(full.grad.transpose(0, -1), vocab_dim, g).transpose(0, -1)  # zeros on padding
    say(f"\n(c) vocab-parallel cross-entropy, V = {vocab}, tp = {tp}: "
        f"{tp * local} columns, {tp * local - vocab} of them padding")
    each_rank("  logits shard, token ids it covers, padding columns, loss, max |logit grad - its slice of one device|",
              f"{list(logits.shape)}  ids [{g.rank * local}, {(g.rank + 1) * local})  "
              f"pad {max(0, (g.rank + 1) * local - vocab)}  loss {loss.item():.12f}  {diff(logits.grad, grad_slice)}")
    say(f"  F.cross_entropy on the gathered [b, s, V] logits: {ref.item():.12f}   |diff| {diff(loss, ref)}")
    say(f"  ledger forward: {calls(fwd)} (= 3 x b*s*8 B);  backward: {calls(bwd)}")
    say(f"  the largest logits on a rank: {list(logits.shape)}; [{B}, {S}, {vocab}] only existed for the check")


def forward_backward(model: Llama, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = model(x, y)
    loss.backward()
    return loss


def part_d(mesh: Mesh) -> None:
    g, cfg = mesh.groups().tp, get_config("tiny")
    x = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(5))
    y = torch.roll(x, -1, dims=1)  # [b, s]: the next token
    ref = Llama(cfg, seed=0).double()
    ref_loss = ref(x, y)
    ref_loss.backward()
    say(f"\n(d) the whole tiny Llama ({cfg.n_layers} layers, {cfg.n_heads} heads, {cfg.n_kv_heads} kv heads), "
        f"b={B} s={S} h={cfg.dim}: one [b, s, h] = {B * S * cfg.dim * 8:,} B")
    for sp in (False, True):
        model = parallelize(Llama(cfg, seed=0), tp=g, sp=sp).double()
        loss, snap = counted(mesh, forward_backward, model, x, y)
        _, partial = counted(mesh, T.sync_partial_grads, model, g)  # replicated weights, partial gradients
        grads = {n: T.unshard(p.grad, p, g) for n, p in model.named_parameters()}
        worst = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
        residual = list(model.tok_emb(x).shape)  # the activation between the parallel regions
        say(f"\n  {f'sequence_parallel={sp}':<28}{'calls':>6}{'payload B':>11}{'sent B':>9}   forward + backward")
        for k, v in snap.items():
            say(f"    {k:<26}{v['calls']:>6}{v['bytes']:>11,}{v['sent']:>9,}")
        total, sent = (sum(v[key] for v in snap.values()) for key in ("bytes", "sent"))
        say(f"    {'total':<32}{total:>11,}{sent:>9,}")
        which = sorted({n.split(".")[-2] for n, p in model.named_parameters() if "tp" in placement_of(p).partial})
        say(f"  then sync_partial_grads: {calls(partial)}  ({', '.join(which) or 'none'})")
        attn = model.get_submodule("layers.0.attn")
        each_rank(f"  residual stream, wq, wk, loss (one device: {ref_loss.item():.12f}), max |grad - one device|",
                  f"{residual}  {list(attn.wq.weight.shape)}  {list(attn.wk.weight.shape)}  "
                  f"{loss.item():.12f}  {worst:.1e}")


def main() -> None:
    start_gloo()
    mesh = Mesh.build(tp=dist.get_world_size())  # one tp group of every rank; its name in the ledger: "tp"
    part_a(mesh)
    part_b(mesh)
    part_c(mesh, 256)
    part_c(mesh, 251)  # a prime: no tp divides it, so the last shard is padded
    part_d(mesh)
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
