"""Context parallelism: the sequence split across ranks, attention computed by passing K/V around a ring.

Chapter 5 of the course (docs/05_context_parallel.md derives all of it). Everything in a layer but
attention treats each token on its own, so the sequence is cut into one piece per cp rank; ring
attention passes the K/V blocks around the cp group, one hop a step, and each rank attends its
queries to each block as it passes, merging the partial results by their log-sum-exps:

    step 0: rank r attends to its own K/V block      send it right, receive from the left
    step 1: the block of rank r-1                    ...
    step cp-1: the block of rank r+1                 every query has now seen every key

Zigzag: the sequence is cut into 2·cp chunks and rank i takes chunks i and 2cp-1-i, so every
rank does the same causal work; RoPE and the mask use global positions (`zigzag_positions`).

    cp = 2, 8 tokens, 4 chunks:   [0 1][2 3][4 5][6 7]   rank 0: chunks 0, 3   rank 1: chunks 1, 2

Ulysses (`--cp-attention ulysses`): two all-to-alls swap the split from tokens to heads and back,
[b, h, s/cp, hd] <-> [b, h/cp, s, hd], with plain attention in between. `install_context_parallel`
puts either into an attention layer, plain or tensor-parallel, through its `positions` and
`attend` seams (model.py); parallelize.py calls it.
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import nn

from minipar.autograd_ops import all_to_all_with_grad
from minipar.collectives import Group, all_reduce, ring_bytes_sent, send_recv
from minipar.model import causal_attention

CP_ATTENTION = ("ring", "ulysses")


def check_cp_layout(seq_len: int, cp: int, attention: str = "ring", n_heads: int = 1, n_kv_heads: int = 1,
                    tp: int = 1) -> None:
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"--seq-len {seq_len} is not divisible by 2 x --cp = {2 * cp}: the zigzag split cuts "
                         f"the sequence into 2 cp equal chunks")
    heads, kv_heads = n_heads // tp, n_kv_heads // tp if n_kv_heads % tp == 0 else 1  # a tp rank's (parallelize)
    if attention == "ulysses" and (heads % cp or kv_heads % cp):
        raise ValueError(f"--cp-attention ulysses: each tp rank's {heads} query heads and {kv_heads} kv heads must "
                         f"both divide by --cp {cp} (the all-to-all gives each cp rank whole heads); use ring")


def zigzag_positions(rank: int, cp: int, seq_len: int, device=None) -> torch.Tensor:
    """Global positions of the tokens rank `rank` holds: chunks rank and 2cp-1-rank."""
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])  # [s/cp]


def split_sequence(t: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag share of a full-sequence tensor (tokens, targets) along `dim`."""
    if group.size == 1:
        return t
    chunks = t.chunk(2 * group.size, dim=dim)
    return torch.cat([chunks[group.rank], chunks[2 * group.size - 1 - group.rank]], dim=dim)


def _block_scores(q, k, q_pos, k_pos, scale):
    """q k^T * scale against one K/V block [b, h, sq, sk], -inf where the causal mask hides a key."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    return scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))


def _block_attention(q, k, v, q_pos, k_pos, scale):
    """Causal attention of q to one K/V block: (output, lse). Rows that see no key get lse = -inf."""
    scores = _block_scores(q, k, q_pos, k_pos, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, sq]
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))  # 0 where masked
    return torch.einsum("bhqk,bhkd->bhqd", probs, v), lse


def _merge(out, lse, block_out, block_lse):
    """The online-softmax merge of two partial attentions."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new_lse), 0.0, new_lse)
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    w_new = torch.exp(block_lse - safe).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, seq_len):
        # q [b, h, s/cp, d]; k, v [b, h_kv, s/cp, d] (this rank's tokens); h = g * h_kv
        cp, r = group.size, group.rank
        scale = q.shape[-1] ** -0.5
        g = q.shape[1] // k.shape[1]
        q_pos = zigzag_positions(r, cp, seq_len, q.device)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])  # travels as one message
        for step in range(cp):
            if step < cp - 1:  # start passing the block on before computing with it: overlap
                incoming = torch.empty_like(kv)
                works = send_recv(kv, (r + 1) % cp, incoming, (r - 1) % cp, group)
            k_pos = zigzag_positions((r - step) % cp, cp, seq_len, q.device)  # the block of rank r - step
            block_k, block_v = (repeat(t, "b h s d -> b (h g) s d", g=g) for t in kv)
            block_out, block_lse = _block_attention(q, block_k, block_v, q_pos, k_pos, scale)
            out, lse = _merge(out, lse, block_out, block_lse)
            if step < cp - 1:
                for w in works:
                    w.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.seq_len = group, seq_len
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, seq_len, cp, r = ctx.group, ctx.seq_len, ctx.group.size, ctx.group.rank
        scale = q.shape[-1] ** -0.5
        g = q.shape[1] // k.shape[1]
        q_pos = zigzag_positions(r, cp, seq_len, q.device)
        delta = (d_out * out).sum(-1, keepdim=True)  # [b, h, sq, 1]: rowsum(dO * O)
        safe_lse = torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1)
        dq = torch.zeros_like(q)
        # The block, with its running gradients, travels the ring once and comes home complete.
        block = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        for step in range(cp):
            k_pos = zigzag_positions((r - step) % cp, cp, seq_len, q.device)  # the block of rank r - step
            bk, bv = (repeat(t, "b h s d -> b (h g) s d", g=g) for t in block[:2])
            probs = torch.exp(_block_scores(q, bk, q_pos, k_pos, scale) - safe_lse)  # the forward's softmax, this block
            dv = torch.einsum("bhqk,bhqd->bhkd", probs, d_out)
            dp = torch.einsum("bhqd,bhkd->bhqk", d_out, bv)
            ds = probs * (dp - delta) * scale
            dq += torch.einsum("bhqk,bhkd->bhqd", ds, bk)
            dk = torch.einsum("bhqk,bhqd->bhkd", ds, q)
            block[2] += rearrange(dk, "b (h g) s d -> b h g s d", g=g).sum(2)
            block[3] += rearrange(dv, "b (h g) s d -> b h g s d", g=g).sum(2)
            if cp > 1:  # pass it on (after the last step, this hop brings each block home)
                incoming = torch.empty_like(block)
                for w in send_recv(block, (r + 1) % cp, incoming, (r - 1) % cp, group):
                    w.wait()
                block = incoming
        return dq, block[2], block[3], None, None


def ring_attention(q, k, v, group: Group, seq_len: int) -> torch.Tensor:
    """Causal attention over the whole sequence, each cp rank holding its zigzag share of it:
    q [b, h, s/cp, d], k and v [b, h_kv, s/cp, d] -> [b, h, s/cp, d]. `seq_len` is the full length."""
    return _RingAttention.apply(q, k, v, group, seq_len)


def ulysses_attention(q, k, v, group: Group, seq_len: int) -> torch.Tensor:
    """Causal attention over the whole sequence by two all-to-alls (see the module docstring):
    q [b, h, s/cp, d], k and v [b, h_kv, s/cp, d], this rank's zigzag tokens -> [b, h, s/cp, d]."""
    cp = group.size
    # Rank i's tokens arrive i-th: their positions in the received order, and the order that sorts them.
    received = torch.cat([zigzag_positions(i, cp, seq_len, q.device) for i in range(cp)])  # [s]
    by_position = torch.argsort(received)

    def all_tokens_of_my_heads(t):  # [b, heads, s/cp, d] -> [b, heads/cp, s, d], in position order
        pieces = rearrange(t, "b (c h) s d -> c b h s d", c=cp)  # piece j: the heads rank j will hold
        mine = all_to_all_with_grad(pieces, group)  # [cp, b, heads/cp, s/cp, d]: piece i from rank i
        return rearrange(mine, "c b h s d -> b h (c s) d")[:, :, by_position]

    out = causal_attention(*(all_tokens_of_my_heads(t) for t in (q, k, v)))  # [b, h/cp, s, d]
    back = rearrange(out[:, :, received], "b h (c s) d -> c b h s d", c=cp)  # piece i: rank i's tokens
    return rearrange(all_to_all_with_grad(back, group), "c b h s d -> b (c h) s d")  # [b, h, s/cp, d]


def install_context_parallel(attn: nn.Module, cp: Group, attention: str = "ring") -> None:
    """Context parallelism through an attention's seams, `positions` and `attend` (model.Attention's, which
    tensor_parallel.ParallelAttention keeps): its tokens are this rank's two zigzag chunks, RoPE'd at their
    global positions, and they attend to the whole sequence by the ring, or by Ulysses' all-to-alls."""
    if attention not in CP_ATTENTION:
        raise ValueError(f"cp_attention {attention!r}: choose one of {', '.join(CP_ATTENTION)}")
    attend = ulysses_attention if attention == "ulysses" else ring_attention
    # local_len, as q's tokens: this rank's s/cp, so the whole sequence is cp times as long
    attn.positions = lambda local_len, device: zigzag_positions(cp.rank, cp.size, local_len * cp.size, device)
    attn.attend = lambda q, k, v: attend(q, k, v, cp, q.shape[2] * cp.size)


def attention_messages(attention: str, tokens: int, heads: int, kv_heads: int, head_dim: int, cp: int,
                       rotated: int, product: int, replay: bool = False) -> list[tuple[str, int]]:
    """The messages one cp rank sends for one layer's attention, forward and backward, as (the ledger's
    key, bytes sent). tokens: the rank's (b s/cp); heads, kv_heads: a tp rank's; rotated, product: the
    widths of q and k (after RoPE, in the weights' dtype) and of v and the output (matmul products).
    replay: --recompute's second forward.

        ring     forward: its K and V, cp-1 hops; backward: K, V, dK, dV, cp hops (the last brings
                 them home). V too in the rotated width: it travels stacked with K, one message a hop.
        ulysses  an all-to-all of q, k, v and one of the output, each sending (cp-1)/cp of it;
                 backward the same four, carrying gradients."""
    forwards = 2 if replay else 1
    if attention == "ring":
        kv = tokens * kv_heads * head_dim * rotated  # this rank's K, or its V
        return [("cp/send", 2 * kv)] * (forwards * (cp - 1)) + [("cp/send", 4 * kv)] * cp
    q_and_out, k_and_v = tokens * heads * head_dim, tokens * kv_heads * head_dim
    one_pass = [q_and_out * rotated, k_and_v * rotated, k_and_v * product, q_and_out * product]  # q, k, v, out
    return [("cp/all_to_all", ring_bytes_sent("all_to_all", n, cp)) for n in one_pass] * (forwards + 1)


def attention_bytes_sent(*args, **kwargs) -> int:
    """Bytes one cp rank sends for one layer's attention: its messages' (attention_messages' arguments)."""
    return sum(n for _, n in attention_messages(*args, **kwargs))


def global_token_count(targets: torch.Tensor, group: Group, ignore_index: int = -100) -> torch.Tensor:
    """Non-ignored target tokens over the whole sequence (summed over cp)."""
    count = (targets != ignore_index).sum().to(torch.float64)
    all_reduce(count, group)
    return count
