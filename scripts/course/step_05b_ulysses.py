"""Step 5b: Ulysses context parallelism, seen from every rank: two all-to-alls instead of a ring.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/course/step_05b_ulysses.py    (4 works too)

All ranks form one cp group; everything is float64 and compared with attention on the whole
sequence on one device (torch's scaled_dot_product_attention, causal). The model has 2 cp query
heads and cp kv heads, so that every rank gets whole heads of both.

(a) what each rank holds: a q whose every entry is labelled with its (head, position), cut by
    zigzag over the cp ranks as the data pipeline cuts it; after the first all-to-all (the same
    one ulysses_attention makes: piece j of the heads goes to rank j), sorted by position; and
    after the second all-to-all, which brings the output back to the tokens' own ranks;
(b) minipar's ulysses_attention against SDPA on one device: output and the gradients of q, k, v;
(c) bytes each rank sent for this attention, forward and backward, from the mesh's ledger: Ulysses'
    all-to-alls ('cp/all_to_all') and the ring's K/V hops ('cp/send'), each next to its closed
    form (context_parallel.attention_bytes_sent); then the closed forms alone for one layer of
    an 8B-shaped model (32 query heads, 8 kv heads of 128) at 8,192 tokens, as cp grows.

Chapter: docs/05_context_parallel.md.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import each_rank, finish, leave, runs, say, start_gloo
from einops import rearrange, repeat

from minipar import context_parallel as C
from minipar.collectives import all_to_all
from minipar.mesh import Mesh

S, B, D = 16, 1, 8  # tokens, batch, head dim


def heads(cp: int) -> tuple[int, int]:
    return 2 * cp, cp  # query heads, kv heads (grouped-query: 2 query heads per kv head)


def qkv(cp: int, seed: int = 0):
    """The full-sequence q [b, h, s, d], k and v [b, h_kv, s, d]: the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    h, h_kv = heads(cp)
    return [torch.randn(B, n, S, D, generator=g, dtype=torch.float64) for n in (h, h_kv, h_kv)]


def sdpa(q, k, v):
    k, v = (repeat(t, "b h s d -> b (h g) s d", g=q.shape[1] // k.shape[1]) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, s, d]


def held(t: torch.Tensor) -> str:
    """'heads 0-1, positions [0..3, 12..15]' of a labelled [b, h, s, d] tensor (entry = 100 head + position)."""
    label = t[0, :, :, 0].long()  # [h, s]
    hs = sorted(set((label // 100).flatten().tolist()))
    pos = (label[0] % 100).tolist()
    return f"heads {hs[0]}-{hs[-1]}, positions {runs(pos)}"


def part_a(mesh: Mesh) -> None:
    g = mesh.groups().cp
    cp, (h, _) = g.size, heads(g.size)
    head, pos = torch.arange(h)[:, None], torch.arange(S)[None, :]
    q = (100 * head + pos).to(torch.float64)[None, :, :, None].expand(B, h, S, D)  # [b, h, s, d], labelled
    say(f"(a) {S} tokens, {h} query heads, cp = {cp}; entry = 100 x head + position, so each rank's q says "
        f"what it holds")
    mine = C.split_sequence(q, g, dim=2)  # [b, h, s/cp, d]: zigzag, as the data pipeline cuts it
    each_rank("  before: this rank's tokens (zigzag), every head       q [b, h, s/cp, d]", held(mine))
    pieces = rearrange(mine, "b (c h) s d -> c b h s d", c=cp)  # piece j: the heads rank j will hold
    received = rearrange(all_to_all(pieces, g), "c b h s d -> b h (c s) d")  # piece i came from rank i
    each_rank("  after the all-to-all: every token, h/cp heads (as received: rank 0's tokens first)    "
              "[b, h/cp, s, d]", held(received))
    order = torch.cat([C.zigzag_positions(i, cp, S) for i in range(cp)])
    each_rank("  sorted by position: the plain causal mask applies", held(received[:, :, torch.argsort(order)]))
    back = rearrange(all_to_all(rearrange(received, "b h (c s) d -> c b h s d", c=cp), g),
                     "c b h s d -> b (c h) s d")  # the second all-to-all: the output's way home
    each_rank("  after the all-to-all back: this rank's tokens, every head again", held(back))
    say(f"  all four move [b, h or h_kv, s/cp, d] per rank; each keeps 1/cp of it and sends (cp-1)/cp "
        f"(here {cp - 1}/{cp})")


def part_b(mesh: Mesh) -> None:
    g = mesh.groups().cp
    q, k, v = qkv(g.size)
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = sdpa(*ref)
    ref_out.backward(d_out)
    local = [C.split_sequence(t, g, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = C.ulysses_attention(*local, g, S)
    out.backward(C.split_sequence(d_out, g, dim=2))
    diffs = [(out.detach() - C.split_sequence(ref_out.detach(), g, dim=2)).abs().max().item()]
    diffs += [(mine.grad - C.split_sequence(theirs.grad, g, dim=2)).abs().max().item()
              for mine, theirs in zip(local, ref)]
    say(f"\n(b) causal attention, b={B} s={S}, {q.shape[1]} query heads and {k.shape[1]} kv heads of {D}, float64")
    each_rank("  C.ulysses_attention: max |Ulysses - SDPA's share| of out, dq, dk, dv",
              "  ".join(f"{d:.1e}" for d in diffs))


def sent(mesh: Mesh, op: str, fn, *args) -> tuple[int, int]:
    """Bytes this rank sent (ledger 'cp/<op>') in fn's forward, and in its backward."""
    mesh.ledger.reset()
    out = fn(*args)
    forward = mesh.ledger.get("cp", op).sent
    out.sum().backward()
    return forward, mesh.ledger.get("cp", op).sent - forward


def part_c(mesh: Mesh) -> None:
    g = mesh.groups().cp
    cp, (h, h_kv) = g.size, heads(g.size)
    local = [C.split_sequence(t, g, dim=2).requires_grad_() for t in qkv(cp)]
    tokens = B * S // cp
    formula = {a: C.attention_bytes_sent(a, tokens, h, h_kv, D, cp, 8, 8) for a in C.CP_ATTENTION}
    say(f"\n(c) bytes sent per rank for this attention, float64: q and out [{B}, {h}, {S // cp}, {D}] = "
        f"{tokens * h * D * 8:,} B each, k and v [{B}, {h_kv}, {S // cp}, {D}] = {tokens * h_kv * D * 8:,} B each")
    for attention, op, fn in (("ulysses", "all_to_all", C.ulysses_attention), ("ring", "send", C.ring_attention)):
        fwd, bwd = sent(mesh, op, fn, *local, g, S)
        each_rank(f"  {attention} (ledger 'cp/{op}'): forward + backward = total; closed form",
                  f"{fwd:,} + {bwd:,} = {fwd + bwd:,} B; {formula[attention]:,} B: {fwd + bwd == formula[attention]}")
    say("  ulysses = 2 x (cp-1)/cp x (q + k + v + out);  ring = (cp-1) x (K + V) forward + cp x (K + V + dK + dV)")
    say("\n  one layer of an 8B-shaped model (32 query heads, 8 kv heads of 128), 8,192 tokens, bf16 throughout, "
        "per rank")
    say(f"  {'cp':>4}{'ring':>14}{'ulysses':>14}   (MiB; closed forms)")
    for n in (2, 4, 8, 16):
        tokens = 8192 // n
        ring, ulysses = (C.attention_bytes_sent(a, tokens, 32, 8, 128, n, 2, 2) / 2**20 for a in C.CP_ATTENTION)
        refused = "       refused   (8 kv heads, 16 ranks)"
        say(f"  {n:>4}{ring:>14.2f}" + (f"{ulysses:>14.2f}" if 8 % n == 0 else refused))


def main() -> None:
    start_gloo()
    mesh = Mesh.build(cp=dist.get_world_size())  # one cp group of every rank; its name in the ledger: "cp"
    part_a(mesh)
    part_b(mesh)
    part_c(mesh)
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
