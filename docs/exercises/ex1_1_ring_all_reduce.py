"""Exercise 1.1 (chapter 1): a ring all-reduce from send and recv, and the bytes it sends.

Implement `ring_all_reduce`: every rank passes in its own tensor `t` (1-D, any length, also one
that N does not divide); every rank gets back the element-wise sum over all N ranks.

The ring: cut t into N chunks (`t.tensor_split(N)` gives uneven ones when N does not divide the
length). Reduce-scatter: N-1 steps, each rank sends one chunk to its right neighbour (rank+1) and
adds the chunk arriving from its left (rank-1) into its own copy; after them, each rank holds one
chunk fully summed. All-gather: N-1 more steps pass the finished chunks around the ring, copying
instead of adding.

Use only the point-to-point calls of `minipar.collectives` on `group` (they write each send in
`group.ledger`, which the checker counts): `send_recv(send_t, dst, recv_t, src, group)` (one
batched hop: returns handles, call `.wait()` on each), or `isend`/`irecv`, or `send`/`recv`.
`group.size` is N, `group.rank` this rank's index. torch.distributed.all_reduce is switched off
while the checker runs.

Then predict, in `bytes_sent_per_rank`, how many bytes each rank sends for a tensor of S bytes on
N ranks when N divides it; the checker compares your formula with what your ring sent.

What the checker reads: the ledger must show only sends and receives, 2(N-1) messages of one
chunk each and 2(N-1)/N * S bytes per rank; the library's `ring_all_reduce` and every collective
that would do it in one call (all-reduce, reduce-scatter, all-gather) are switched off.

The library's own, after you tried: `ring_all_reduce` in minipar/collectives.py.

Check: make exercise N=1.1 (2, 3 and 4 ranks, a few seconds)
"""

import torch

from minipar.collectives import Group, irecv, isend, recv, send, send_recv  # noqa: F401 - yours to use


def ring_all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    """Return the sum over the group's ranks of every rank's t (1-D). May work in place."""
    raise NotImplementedError("hint: chunks = list(t.clone().tensor_split(group.size)); at reduce-scatter "
                              "step k rank r sends chunk (r - k) % N right and adds the arriving one into "
                              "chunk (r - k - 1) % N")


def bytes_sent_per_rank(S: int, N: int) -> float:
    """Predict: bytes one rank sends in your ring all-reduce of S bytes on N ranks (N divides S)."""
    raise NotImplementedError("hint: how many steps, and how big is one chunk?")
