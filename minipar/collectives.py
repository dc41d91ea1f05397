"""Collectives: every message minipar sends goes through this file, and is written in one ledger.

Chapter 1 of the course. Six operations carry all of distributed training. Picture four ranks,
each holding one tensor (a, b, c, d are whole tensors, a0 is a quarter of a):

    all-reduce       [a] [b] [c] [d]          -> [a+b+c+d] on every rank
    all-gather       [a] [b] [c] [d]          -> [a b c d] on every rank
    reduce-scatter   [a0 a1 a2 a3] [b0 ..] .. -> rank i holds a_i+b_i+c_i+d_i
    broadcast        [a] [ ] [ ] [ ]          -> [a] on every rank
    all-to-all       rank i sends its j-th chunk to rank j
    send / recv      one rank to one other (pipeline stages, the context-parallel ring)

reduce, gather, scatter and barrier (a root, or no data) are here too; no layer calls them. The
`Ledger` counts, per (group, op), the calls, the payload and the bytes this rank sends by the
ring's formulas (`ring_bytes_sent`), split into bytes that stay in the node and bytes that cross;
`ring_all_reduce` writes the all-reduce with send/recv, so its 2(N-1)/N can be counted. The
autograd-aware operators built on these (Megatron's f and g, experts' all-to-all) are in
autograd_ops.py. Read docs/01_collectives.md: the byte table, the ring, the nodes, the trace.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minipar.comm_clock import WaitClock

# -- The ledger -----------------------------------------------------------------------------------


@dataclass
class Entry:
    calls: int = 0
    bytes: int = 0  # payload: size of the tensor handed to the op
    sent: int = 0  # bytes this rank puts on the wire under the ring algorithm
    intra: int = 0  # of sent: to ranks on this rank's node
    cross: int = 0  # of sent: to ranks on other nodes


# How many payload bytes one rank sends, by the ring algorithm, for a payload of S bytes on N ranks.
def ring_bytes_sent(op: str, nbytes: int, n: int) -> int:
    if n == 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * nbytes // n
    if op in ("broadcast", "reduce", "send"):
        return nbytes
    return 0  # recv


@dataclass
class Ledger:
    """Calls and bytes per (group name, op), shared by all groups of one mesh. `trace`: None, or a
    list that receives (communicator, op, peer, bytes) for every operation in posting order
    (communicator: (name, ranks); peer: the other rank's global number for send/recv, else None).
    `listeners`: functions called with (group, op, its ranks, peer or None, payload bytes) for each
    operation asked of other ranks; the ledger only counts, whoever needs more listens (ops/hang.py)."""

    entries: dict[tuple[str, str], Entry] = field(default_factory=lambda: defaultdict(Entry))
    trace: list[tuple] | None = None
    listeners: list[Callable[[str, str, tuple, int | None, int], None]] = field(default_factory=list)
    clock: WaitClock | None = None  # times how long this rank waits in each group's calls (Group._call)

    def record(self, group: str, op: str, nbytes: int, sent: int, cross: int = 0) -> None:
        """One operation: its payload, the bytes it sends, and how many of those leave the node."""
        e = self.entries[(group, op)]
        e.calls += 1
        e.bytes += nbytes
        e.sent += sent
        e.intra += sent - cross
        e.cross += cross

    def reset(self) -> None:
        self.entries.clear()

    def get(self, group: str, op: str) -> Entry:
        return self.entries.get((group, op), Entry())

    def total_sent(self) -> int:
        return sum(e.sent for e in self.entries.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain dict {"group/op": {"calls", "bytes", "sent", "intra", "cross"}}, for logs and JSON."""
        return {f"{g}/{op}": vars(e).copy() for (g, op), e in sorted(self.entries.items())}

    def table(self) -> str:
        row = "{:<24}{calls:>8}{bytes:>16,}{sent:>14,}{intra:>14,}{cross:>14,}".format
        return "\n".join([f"{'group/op':<24}{'calls':>8}{'payload bytes':>16}{'sent bytes':>14}{'intra-node':>14}"
                          f"{'cross-node':>14}"] + [row(key, **e) for key, e in self.snapshot().items()])


@dataclass
class Group:
    """A named process group: its ranks, and the ledger that its traffic is written in.
    ranks_per_node: global rank r lives on node r // ranks_per_node (None: every rank on one node)."""

    name: str
    pg: dist.ProcessGroup
    ranks: list[int]
    ledger: Ledger
    ranks_per_node: int | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This rank's index inside the group."""
        return 0 if self.size == 1 else self.ranks.index(dist.get_rank())

    def node(self, i: int) -> int:
        """The node of group rank i."""
        return 0 if self.ranks_per_node is None else self.ranks[i] // self.ranks_per_node

    def crosses(self, to: int) -> bool:
        """Whether this rank's bytes to group rank `to` leave its node."""
        return self.ranks_per_node is not None and self.node(to) != self.node(self.rank)

    @classmethod
    def solo(cls, name: str) -> Group:
        """A group of one, needing no process group: a model built with it is the plain model."""
        return cls(name, None, [0], Ledger())

    @property
    def communicator(self) -> tuple[str, tuple[int, ...]]:
        """Names the process group itself (groups of other names may share WORLD's), and its ranks."""
        return ("world" if self.pg is dist.group.WORLD else self.name), tuple(self.ranks)

    def _note(self, op: str, t: torch.Tensor | None, peer: int | None = None, nbytes: int | None = None,
              sent: int | None = None, cross: int | None = None) -> None:
        """Write the ledger line of one operation (peer: a group rank, for send and recv; cross: the
        bytes that leave the node, when they go elsewhere than to the peer or the ring's next rank)."""
        nbytes = t.nbytes if nbytes is None else nbytes
        sent = ring_bytes_sent(op, nbytes, self.size) if sent is None else sent
        if cross is None:  # a ring's bytes all go to the next rank of the ring (chapter 1's model)
            cross = sent if self.crosses(peer if peer is not None else (self.rank + 1) % self.size) else 0
        self.ledger.record(self.name, op, nbytes, sent, cross=cross)
        for listen in self.ledger.listeners if self.size > 1 else ():
            listen(self.name, op, tuple(self.ranks), None if peer is None else self.ranks[peer], nbytes)
        if self.ledger.trace is not None and self.size > 1:
            self.ledger.trace.append((self.communicator, op, None if peer is None else self.ranks[peer], nbytes))

    def _call(self, call: Callable, /, *args, **kwargs):
        """call(*args, **kwargs), a torch.distributed function, through the ledger's clock if it has one."""
        clock = self.ledger.clock
        return call(*args, **kwargs) if clock is None else clock.run(self.name, call, *args, **kwargs)


# -- The operations. Each writes its ledger line, then calls torch.distributed through Group._call. Ops
# -- on a group of one rank do nothing and cost nothing, so code can call them unconditionally.

_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    """In place: t <- op over the group of t. Returns a work handle when async_op."""
    group._note("all_reduce", t)
    if group.size == 1:
        return None
    return group._call(dist.all_reduce, t, op=_REDUCE[op], group=group.pg, async_op=async_op)


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's t along `dim`, in group order. The ledger counts the output, S."""
    group._note("all_gather", t, nbytes=t.nbytes * group.size)
    if group.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(group.size)]
    group._call(dist.all_gather, parts, t.contiguous(), group=group.pg)
    return torch.cat(parts, dim=dim)


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: Group, async_op: bool = False):
    """All-gather t into the flat buffer `out` (N times t's size), in place: rank j's t lands in
    the j-th chunk. Returns a work handle when async_op (ZeRO-3 prefetches this way)."""
    group._note("all_gather", out)
    if group.size == 1:
        out.copy_(t.reshape(-1))
        return None
    return group._call(dist.all_gather, list(out.chunk(group.size)), t.contiguous(), group=group.pg, async_op=async_op)


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0, async_op: bool = False):
    """Sum over the group, then keep this rank's 1/N slice along `dim`. async_op: (the slice, a work
    handle to wait on before reading it; None on a group of one)."""
    group._note("reduce_scatter", t)
    if group.size == 1:
        return (t, None) if async_op else t
    if t.shape[dim] % group.size:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by {group.size}")
    chunks = [c.contiguous() for c in t.chunk(group.size, dim=dim)]
    out = torch.empty_like(chunks[0])
    work = group._call(dist.reduce_scatter, out, chunks, group=group.pg, async_op=async_op)
    return (out, work) if async_op else out


def broadcast(t: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """In place: every rank's t <- the t of group rank `src`."""
    group._note("broadcast", t)
    if group.size > 1:
        group._call(dist.broadcast, t, src=group.ranks[src], group=group.pg)
    return t


def all_to_all(t: torch.Tensor, group: Group, dim: int = 0, send_splits: list[int] | None = None,
               recv_splits: list[int] | None = None) -> torch.Tensor:
    """Cut t along `dim` into N pieces (equal, or of sizes `send_splits`); piece j goes to rank j;
    the pieces received (of sizes `recv_splits`: what each rank sends this one) are concatenated.
    The ledger counts the pieces this rank sends to others, whatever their sizes."""
    if send_splits is None:
        send_splits = recv_splits = [t.shape[dim] // group.size] * group.size
    row_bytes = t.numel() // max(1, t.shape[dim]) * t.element_size()
    payload = t.shape[dim] * row_bytes
    across = sum(rows for j, rows in enumerate(send_splits) if group.crosses(j))  # piece j goes to rank j
    group._note("all_to_all", None, nbytes=payload, sent=(t.shape[dim] - send_splits[group.rank]) * row_bytes,
                cross=across * row_bytes)
    if group.size == 1:
        return t
    rows = t.movedim(dim, 0).contiguous()  # the pieces are runs of rows along dim 0
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    group._call(dist.all_to_all_single, out, rows, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                group=group.pg)
    return out.movedim(0, dim)


def reduce(t: torch.Tensor, group: Group, dst: int = 0, op: str = "sum") -> torch.Tensor | None:
    """op over the group, onto group rank `dst` only: returns t (reduced in place) there, None elsewhere
    (where t's contents are left undefined: a ring may use it for partial sums)."""
    group._note("reduce", t)
    if group.size > 1:
        group._call(dist.reduce, t, dst=group.ranks[dst], op=_REDUCE[op], group=group.pg)
    return t if group.rank == dst else None


def gather(t: torch.Tensor, group: Group, dst: int = 0) -> torch.Tensor | None:
    """Every rank's t concatenated along dim 0, in group order, on group rank `dst`; None elsewhere.
    The ledger counts the output, S; each other rank sends its own S/N, the root nothing."""
    sent = 0 if group.rank == dst else t.nbytes  # straight to the root: it crosses when the root is elsewhere
    group._note("gather", t, nbytes=t.nbytes * group.size, sent=sent, cross=sent if group.crosses(dst) else 0)
    if group.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(group.size)] if group.rank == dst else None
    group._call(dist.gather, t.contiguous(), parts, dst=group.ranks[dst], group=group.pg)
    return None if parts is None else torch.cat(parts)


def scatter(t: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """Group rank `src` cuts its t along dim 0 into N chunks and rank i receives chunk i (every rank
    passes a t of the same shape; only the root's is read). The root sends the other N-1 chunks."""
    chunks_out = [i for i in range(group.size) if i != src] if group.rank == src else []  # the root's N-1 chunks
    group._note("scatter", t, sent=len(chunks_out) * t.nbytes // group.size,
                cross=sum(group.crosses(i) for i in chunks_out) * t.nbytes // group.size)
    if group.size == 1:
        return t
    if t.shape[0] % group.size:
        raise ValueError(f"scatter: dim 0 of size {t.shape[0]} is not divisible by {group.size}")
    out = torch.empty_like(t.chunk(group.size)[0])  # [S/N rows, ...]
    chunks = [c.contiguous() for c in t.chunk(group.size)] if group.rank == src else None
    group._call(dist.scatter, out, chunks, src=group.ranks[src], group=group.pg)
    return out


def barrier(group: Group) -> None:
    """Wait until every rank of the group has called it: no bytes, only a round of messages (a
    latency, alpha in chapter 1's time model)."""
    group._note("barrier", None, nbytes=0, sent=0)
    if group.size > 1:
        group._call(dist.barrier, group=group.pg)


def send(t: torch.Tensor, group: Group, dst: int) -> None:
    """Send to group rank `dst`."""
    group._note("send", t, dst)
    group._call(dist.send, t.contiguous(), dst=group.ranks[dst], group=group.pg)


def recv(t: torch.Tensor, group: Group, src: int) -> torch.Tensor:
    """Receive into t from group rank `src`."""
    group._note("recv", t, src)
    group._call(dist.recv, t, src=group.ranks[src], group=group.pg)
    return t


def isend(t: torch.Tensor, group: Group, dst: int):
    """Start sending to group rank `dst`; returns the work handle (keep t alive until it is done).
    No tag: the peer's receives take messages in the order they were sent, as on NCCL."""
    group._note("send", t, dst)
    return group._call(dist.isend, t.contiguous(), dst=group.ranks[dst], group=group.pg)


def irecv(t: torch.Tensor, group: Group, src: int):
    """Start receiving into t from group rank `src`; returns the work handle."""
    group._note("recv", t, src)
    return group._call(dist.irecv, t, src=group.ranks[src], group=group.pg)


def send_recv(send_t: torch.Tensor, dst: int, recv_t: torch.Tensor, src: int, group: Group):
    """Send to group rank `dst` and receive from `src` as one batched operation (a ring hop).
    Returns the work handles. Batched, so that two ranks exchanging with each other cannot each sit
    in a send waiting for the other's receive (NCCL queues p2p calls between a pair in order)."""
    group._note("send", send_t, dst)
    group._note("recv", recv_t, src)
    ops = [dist.P2POp(dist.isend, send_t.contiguous(), group.ranks[dst], group.pg),
           dist.P2POp(dist.irecv, recv_t, group.ranks[src], group.pg)]
    return group._call(dist.batch_isend_irecv, ops)


def gather_object(obj, group: Group, dst: int = 0) -> list | None:
    """Every rank's picklable `obj`, in group order, on group rank `dst` (None on the others). Each rank
    pickles its own, the ranks agree on the longest (an 8-byte all-reduce), and the byte tensors, padded
    to it, are gathered on `dst` (ledger: "gather"). Checkpoints collect the pipeline's stages so."""
    if group.size == 1:
        return [obj]
    raw = bytearray(pickle.dumps(obj))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group.pg) == "nccl" else "cpu"
    longest = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    all_reduce(longest, group, op="max")
    raw.extend(bytes(int(longest.item()) - len(raw)))  # pickle.loads ignores what follows the object
    mine = torch.frombuffer(raw, dtype=torch.uint8).to(device)  # [longest]
    sent = 0 if group.rank == dst else len(raw)  # dst keeps its own
    group._note("gather", mine, sent=sent, cross=sent if group.crosses(dst) else 0)
    parts = [torch.empty_like(mine) for _ in range(group.size)] if group.rank == dst else None
    group._call(dist.gather, mine, parts, dst=group.ranks[dst], group=group.pg)
    return None if parts is None else [pickle.loads(p.cpu().numpy().tobytes()) for p in parts]


def ring_all_reduce(t: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) written out with send/recv, as the ring algorithm does it. In place.

    The tensor is cut into N chunks. Reduce-scatter: for N-1 steps every rank sends one chunk to
    its right neighbour and adds the chunk arriving from its left; afterwards rank i holds the full
    sum of chunk i+1. All-gather: N-1 more steps pass the finished chunks around the ring. Every
    rank sent 2(N-1) chunks of S/N bytes: the 2(N-1)/N * S of the formula."""
    n, i = group.size, group.rank
    if n == 1:
        return t
    flat = t.view(-1)
    if flat.numel() % n:
        raise ValueError(f"ring_all_reduce: {flat.numel()} elements do not split into {n} chunks")
    chunks = flat.chunk(n)
    right, left = (i + 1) % n, (i - 1) % n
    incoming = torch.empty_like(chunks[0])

    def exchange(send_idx: int, recv_idx: int, reduce: bool) -> None:
        # Even ranks send first, odd ranks receive first: no two neighbours block on send together.
        if i % 2 == 0:
            send(chunks[send_idx], group, right)
            recv(incoming, group, left)
        else:
            recv(incoming, group, left)
            send(chunks[send_idx], group, right)
        chunks[recv_idx].add_(incoming) if reduce else chunks[recv_idx].copy_(incoming)

    for step in range(n - 1):  # reduce-scatter
        exchange((i - step) % n, (i - step - 1) % n, reduce=True)
    for step in range(n - 1):  # all-gather
        exchange((i + 1 - step) % n, (i - step) % n, reduce=False)
    return t
