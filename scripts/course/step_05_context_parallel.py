"""Step 5: context parallelism, seen from every rank: which tokens it holds, what passes round the ring.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/course/step_05_context_parallel.py    (4 works too)

All ranks form one cp group; everything is float64 and compared with attention on the whole
sequence on one device (torch's scaled_dot_product_attention, causal).

(a) a sequence of 16 tokens cut contiguously and zigzag: the positions each rank holds, the
    causal mask with every visible (query, key) pair labelled by the rank that computes it, and
    the pairs per rank and per ring step: contiguous is unbalanced, zigzag equal;
(b) one attention, 4 query heads and 2 kv heads, over the ring step by step: whose K/V block
    arrives, which positions it holds, the running log-sum-exp of one query after each merge and
    how far the running output still is from SDPA; then minipar's ring_attention with its
    hand-written backward: output and gradients against SDPA's;
(c) memory: every tensor autograd keeps for backward, counted with saved_tensors_hooks, for ring
    attention on each rank and for the whole sequence on one device (ring_attention on a group of
    one, SDPA's CPU kernel, SDPA's math path with its [s, s] probabilities);
(d) bytes each rank sent, from the mesh's ledger ('cp/send'), forward and backward, next to the
    formula: forward cp-1 hops of the local K/V, backward cp hops of K, V, dK and dV.

Chapter: docs/05_context_parallel.md.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import each_rank, finish, leave, runs, say, start_gloo
from einops import repeat
from torch.nn.attention import SDPBackend, sdpa_kernel

from minipar import context_parallel as C
from minipar.collectives import Group, irecv, isend
from minipar.mesh import Mesh

S = 16  # tokens in (a), (b) and (d)
B, H, H_KV, D = 1, 4, 2, 8  # batch, query heads, kv heads (GQA: 2 query heads per kv head), head dim
S_MEM, D_MEM = 512, 16  # (c): long enough for the [s, s] scores to dominate


def contiguous_positions(rank: int, cp: int, seq_len: int) -> torch.Tensor:
    n = seq_len // cp
    return torch.arange(rank * n, (rank + 1) * n)


def pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """(query, key) pairs with key <= query: the causal work of these queries on these keys."""
    return int((q_pos[:, None] >= k_pos[None, :]).sum())


def qkv(seq_len: int, head_dim: int, seed: int = 0):
    """The full-sequence q [b, h, s, d], k and v [b, h_kv, s, d]: the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, seq_len, head_dim, generator=g, dtype=torch.float64) for n in (H, H_KV, H_KV)]


def sdpa(q, k, v):
    """Causal attention on the whole sequence, one device; kv heads repeated for their query heads."""
    k, v = (repeat(t, "b h s d -> b (h g) s d", g=H // H_KV) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, s, d]


def full_lse(q, k) -> torch.Tensor:
    """log sum_k exp(q.k / sqrt(d)) over the keys each query sees: [b, h, s]."""
    k = repeat(k, "b h s d -> b (h g) s d", g=H // H_KV)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return torch.logsumexp(scores.masked_fill(~causal, float("-inf")), dim=-1)


def part_a(mesh: Mesh) -> None:
    g = mesh.groups().cp
    cp, r = g.size, g.rank
    split = {"contiguous": [contiguous_positions(i, cp, S) for i in range(cp)],
             "zigzag": [C.zigzag_positions(i, cp, S) for i in range(cp)]}
    say(f"(a) {S} tokens on cp = {cp} ranks; causal attention: query q sees keys 0..q, "
        f"{S * (S + 1) // 2} (query, key) pairs in all")
    owner = {name: torch.empty(S, dtype=torch.long) for name in split}
    for name, held in split.items():
        for i, pos in enumerate(held):
            owner[name][pos] = i
    say("\n  the causal mask, row = query, column = key; each visible pair shows the rank holding its query")
    say(f"  {'contiguous':<{S + 6}}   zigzag (chunk i pairs with chunk {2 * cp - 1} - i)")
    for q in range(S):
        rows = ["".join(str(int(owner[name][q])) if k <= q else "." for k in range(S)) for name in split]
        say(f"  {q:>2}  {rows[0]}     {q:>2}  {rows[1]}")
    for name, held in split.items():
        mine = held[r]
        per_step = [pairs(mine, held[(r - step) % cp]) for step in range(cp)]  # the block arriving at step t
        line = f"{runs(mine.tolist()):<18} {pairs(mine, torch.arange(S)):>4} pairs   steps {per_step}"
        each_rank(f"\n  {name}: positions held, causal pairs computed, pairs per ring step" if name == "contiguous"
                  else f"  {name}:", line)
    work = {name: [pairs(p, torch.arange(S)) for p in held] for name, held in split.items()}
    for name, w in work.items():
        steps = [max(pairs(held_r, split[name][(i - t) % cp]) for i, held_r in enumerate(split[name]))
                 for t in range(cp)]
        say(f"  {name:<10}: busiest rank {max(w)} pairs = {max(w) * cp / sum(w):.2f} x the mean {sum(w) / cp:g}; "
            f"each ring step lasts as long as its busiest rank: {' + '.join(map(str, steps))} = {sum(steps)}")


def ring_trace(mesh: Mesh, q, k, v, ref_out, ref_lse) -> None:
    """The forward loop of ring_attention written out, printing what arrives and the merge after each step."""
    g = mesh.groups().cp
    cp, r = g.size, g.rank
    scale = D ** -0.5
    q_pos = C.zigzag_positions(r, cp, S)
    follow = len(q_pos) - 1  # this rank's last query: a late token, it sees keys from every block
    out = torch.zeros_like(q)  # [b, h, s/cp, d]
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)  # [b, h, s/cp]
    kv = torch.stack([k, v])  # [2, b, h_kv, s/cp, d]: one message
    say("\n  ring_attention's forward loop written out (with its helpers C._block_attention and C._merge).\n"
        "  Each step: the K/V block that arrived and its positions; for head 0 of this rank's last query,\n"
        "  the lse of that block and the merged lse so far; rows whose lse is final; max |out - SDPA| so far")
    for step in range(cp):
        if step < cp - 1:
            incoming = torch.empty_like(kv)
            works = [isend(kv, g, (r + 1) % cp), irecv(incoming, g, (r - 1) % cp)]  # in order, no tags
        owner = (r - step) % cp
        k_pos = C.zigzag_positions(owner, cp, S)
        block_k, block_v = (repeat(t, "b h s d -> b (h g) s d", g=H // H_KV) for t in kv)
        block_out, block_lse = C._block_attention(q, block_k, block_v, q_pos, k_pos, scale)
        out, lse = C._merge(out, lse, block_out, block_lse)
        done = int(torch.isclose(lse[0, 0], ref_lse[0, 0], rtol=0, atol=1e-12).sum())
        each_rank(f"  step {step}", f"K/V of rank {owner} {runs(k_pos.tolist()):<16} pos {int(q_pos[follow]):>2}: "
                  f"block {float(block_lse[0, 0, follow]):7.4f}  merged {float(lse[0, 0, follow]):7.4f}   "
                  f"rows done {done}/{len(q_pos)}   {(out - ref_out).abs().max().item():.1e}")
        if step < cp - 1:
            for w in works:
                w.wait()
            kv = incoming
    each_rank("  the whole sequence on one device: lse of the same query, and |ring - it|",
              f"pos {int(q_pos[follow]):>2}: {float(ref_lse[0, 0, follow]):7.4f}   "
              f"{abs(float(lse[0, 0, follow] - ref_lse[0, 0, follow])):.1e}")


def part_b(mesh: Mesh) -> None:
    g = mesh.groups().cp
    q, k, v = qkv(S, D)
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = sdpa(*ref)
    ref_out.backward(d_out)
    ref_lse = C.split_sequence(full_lse(q, k), g, dim=2)  # [b, h, s/cp]: this rank's queries
    say(f"\n(b) causal attention, b={B} s={S}, {H} query heads and {H_KV} kv heads of {D}, float64; "
        f"each rank holds q [{B}, {H}, {S // g.size}, {D}] and k, v [{B}, {H_KV}, {S // g.size}, {D}]")
    local = [C.split_sequence(t, g, dim=2) for t in (q, k, v)]
    ring_trace(mesh, *local, C.split_sequence(ref_out.detach(), g, dim=2), ref_lse)

    local = [t.clone().requires_grad_() for t in local]
    out = C.ring_attention(*local, g, S)  # minipar's: the same loop forward, the ring backward by hand
    out.backward(C.split_sequence(d_out, g, dim=2))
    diffs = [(out.detach() - C.split_sequence(ref_out.detach(), g, dim=2)).abs().max().item()]
    diffs += [(mine.grad - C.split_sequence(theirs.grad, g, dim=2)).abs().max().item() for mine, theirs
              in zip(local, ref)]
    each_rank("\n  C.ring_attention forward and hand-written backward: max |ring - SDPA's share| of out, dq, dk, dv",
              "  ".join(f"{d:.1e}" for d in diffs))


def saved_by(fn, *inputs) -> list[torch.Tensor]:
    """Run fn(*inputs); return the tensors autograd kept for its backward, one per storage."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    unique = {}
    for t in saved:  # a tensor saved twice, or as two views, is held once
        unique.setdefault(t.untyped_storage().data_ptr(), t)
    return list(unique.values())


def held(tensors) -> tuple[int, str]:
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    return total, " ".join(str(list(t.shape)).replace(" ", "") for t in tensors)


def part_c(mesh: Mesh) -> None:
    g = mesh.groups().cp
    cp = g.size
    q, k, v = (t.requires_grad_() for t in qkv(S_MEM, D_MEM))
    local = [C.split_sequence(t.detach(), g, dim=2).requires_grad_() for t in (q, k, v)]
    ring, ring_shapes = held(saved_by(C.ring_attention, *local, g, S_MEM))
    say(f"\n(c) memory kept for backward, s={S_MEM}, b={B}, {H} heads, {H_KV} kv heads of {D_MEM}, float64 "
        f"(saved_tensors_hooks, one count per storage)")
    each_rank(f"  ring attention at cp = {cp}, on each rank", f"{ring:>10,} B   {ring_shapes}")
    if g.rank != 0:
        dist.barrier()
        return
    solo = Group.solo("cp")  # the same function on one device: no ring, the whole sequence
    whole = {"ring_attention on one device": held(saved_by(C.ring_attention, q, k, v, solo, S_MEM)),
             "SDPA, CPU flash kernel": held(saved_by(sdpa, q, k, v))}
    with sdpa_kernel(SDPBackend.MATH):
        whole["SDPA, math path"] = held(saved_by(sdpa, q, k, v))
    print("  the whole sequence on one device")
    for name, (total, shapes) in whole.items():
        print(f"    {name:<30}{total:>10,} B = {total / ring:5.2f} x a ring rank   {shapes}")
    kv = 2 * B * H_KV * S_MEM * D_MEM * 8
    print(f"  K/V of the whole sequence: {kv:,} B. A ring rank keeps its own {kv // cp:,} B (1/{cp}) and has "
          f"one block in flight;\n  all-gather context parallelism would keep the gathered {kv:,} B on every rank")
    dist.barrier()


def part_d(mesh: Mesh) -> None:
    g = mesh.groups().cp
    cp = g.size
    local = [C.split_sequence(t, g, dim=2).requires_grad_() for t in qkv(S, D)]
    kv_bytes = 2 * B * H_KV * (S // cp) * D * 8  # this rank's K and V
    mesh.ledger.reset()
    out = C.ring_attention(*local, g, S)
    fwd = mesh.ledger.get("cp", "send")
    mesh.ledger.reset()
    out.sum().backward()
    bwd = mesh.ledger.get("cp", "send")
    say(f"\n(d) bytes sent per rank (ledger 'cp/send'), s={S}: local K/V = 2 x [{B}, {H_KV}, {S // cp}, {D}] "
        f"float64 = {kv_bytes:,} B")
    each_rank(f"  forward: calls, bytes, formula (cp-1) x {kv_bytes:,};  "
              f"backward: calls, bytes, formula cp x 2 x {kv_bytes:,} (K, V, dK, dV)",
              f"forward {fwd.calls} {fwd.bytes:,} B = {(cp - 1) * kv_bytes:,}: {fwd.bytes == (cp - 1) * kv_bytes}   "
              f"backward {bwd.calls} {bwd.bytes:,} B = {cp * 2 * kv_bytes:,}: {bwd.bytes == cp * 2 * kv_bytes}")
    say(f"  for scale, all-gather context parallelism: forward all-gather of K/V, (cp-1)/cp x {cp} x "
        f"{kv_bytes:,} = {(cp - 1) * kv_bytes:,} B;\n  backward reduce-scatter of dK/dV, {(cp - 1) * kv_bytes:,} B "
        f"(the ring's backward sends {cp * 2 * kv_bytes / max(1, (cp - 1) * kv_bytes):.1f}x that: "
        f"K and V travel again instead of being kept)")


def main() -> None:
    start_gloo()
    mesh = Mesh.build(cp=dist.get_world_size())  # one cp group of every rank; its name in the ledger: "cp"
    part_a(mesh)
    part_b(mesh)
    part_c(mesh)
    part_d(mesh)
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
