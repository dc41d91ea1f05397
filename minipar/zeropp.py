"""ZeRO++: ZeRO-3 with about a quarter of its cross-node bytes (qwZ, hpZ, qgZ).

Chapter 3c of the course. ZeRO-3 (zero3.py) sends three times the weights per step, and between
nodes they cross a network ten times slower than NVLink or more. ZeRO++ (Wang et al., 2023) cuts
what crosses, three ways, each a flag (`--zeropp qwz,hpz,qgz`, any subset):

    qwZ  the forward all-gather sends each shard as int8 blocks (quantize.py)
    hpZ  each rank keeps a 1/K copy of every unit, cut from forward's gather: backward gathers
         inside the node alone (K: the dp ranks of a node)
    qgZ  the gradient reduce-scatter becomes two all-to-alls of int4 blocks, summed in full
         precision between the hops: hop 1 inside the node, hop 2 across

    dp ranks  d = node * K + j              hop 1 (inside each node)       hop 2 (across)
      node 0: [d0 d1]  node 1: [d2 d3]      d0 <-> d1,  d2 <-> d3          d0 <-> d2,  d1 <-> d3
    dp_intra groups {d0 d1} {d2 d3}; dp_cross groups {d0 d2} {d1 d3} (split_dp_by_node(mesh))

ZeRO-3 knows none of this: `ZeroPP` is a zero3.Transport, which build_grad_sync hands the wrapper.
Read docs/03c_zero_plus_plus.md: the bytes each option sends and crosses, and why int4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from minipar.collectives import Group, all_gather_into, all_to_all
from minipar.mesh import Groups, LayoutError, Mesh, MeshLayout
from minipar.quantize import dequantize, quantize
from minipar.zero3 import ShardedBucket, Transport

OPTIONS = ("qwz", "hpz", "qgz")
SPLIT = ("hpz", "qgz")  # the options that split the dp group by node (split_dp_by_node)
BLOCK = 256  # numbers per scale: 4 scale bytes per 256 codes, 1.6% more than the codes alone


def parse(text: str) -> tuple[str, ...]:
    """'qwz,hpz' -> ('qwz', 'hpz'); ValueError for a name that is none of OPTIONS."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names or not set(names) <= set(OPTIONS):
        raise ValueError(f"--zeropp {text}: choose any of {', '.join(OPTIONS)}, separated by commas")
    return names


def check(names: tuple[str, ...], layout, cp: int = 1, experts: int = 0) -> None:
    """ValueError, one line, where --zeropp's `names` (parsed) cannot apply on `layout` (a MeshLayout; the stage
    they need: parallelize.check_zero). hpz and qgz need several nodes: on one there is no slow link to spare."""
    split = check_split(names, "--cp" if cp > 1 else "the experts" if experts else None)
    if split and layout.nodes == 1:
        raise ValueError(f"--zeropp {split} splits the dp ranks by node, and this run has one node: give "
                         "--ranks-per-node (on one machine it simulates several nodes), or use qwz alone")
    if split:
        dp_per_node(layout)  # raises LayoutError (a ValueError) unless each node holds an equal run of dp


def check_split(names: tuple[str, ...], others: str | None) -> str:
    """Those of `names` that split the dp group by node, joined; refused where `others` reduce over another group."""
    if (split := ",".join(n for n in names if n in SPLIT)) and others:
        raise ValueError(f"--zeropp {split} splits the dp group by node, but {others} reduce gradients over other "
                         "groups: use qwz alone")
    return split


def dp_per_node(layout: MeshLayout) -> int:
    """How many ranks of each dp group share a node: K / (cp x tp) if cp x tp divides K and that dp."""
    k, inner = layout.ranks_per_node or layout.world_size, layout.cp * layout.tp
    if inner % k == 0:  # each dp rank's cp x tp block fills whole nodes
        return 1
    if k % inner or layout.dp % (k // inner):
        raise LayoutError(f"{k} ranks per node hold {k / inner:g} ranks of each dp group of {layout.dp} (cp "
                          f"{layout.cp} x tp {layout.tp} = {inner} per dp rank): give a --ranks-per-node that "
                          "splits dp evenly")
    return k // inner


def split_dp_by_node(mesh: Mesh) -> None:
    """Cut each dp group into its ranks on one node (dp_intra, K of them) and the ranks at the same
    place on each node (dp_cross, one per node): dp = dp_cross x dp_intra. Every rank calls it at once."""
    per_node = dp_per_node(mesh.layout)
    mesh.unflatten(("dp",), dp_cross=mesh.layout.dp // per_node, dp_intra=per_node)


@dataclass(frozen=True)
class ZeroPP(Transport):
    """ZeRO-3's messages sent ZeRO++'s ways (a zero3.Transport, handed to Zero3DataParallel): the
    options it uses, and the groups hpZ and qgZ talk over (`over` takes them from the mesh's)."""

    options: tuple[str, ...] = ()
    intra: Group | None = None  # the dp ranks on this rank's node
    cross: Group | None = None  # the dp ranks at this rank's place on each node
    dp: Group | None = None  # the group they split; a bucket reduced over another takes qwZ alone
    weight_bits: int = 8
    grad_bits: int = 4
    block: int = BLOCK

    qwz = property(lambda self: "qwz" in self.options)
    hpz = property(lambda self: "hpz" in self.options)
    qgz = property(lambda self: "qgz" in self.options)

    @classmethod
    def over(cls, groups: Groups, options: tuple[str, ...]) -> ZeroPP:
        if set(SPLIT) & set(options) and "dp_intra" not in groups.more:
            raise ValueError(f"ZeRO++ {','.join(options)}: hpz and qgz need the dp group split by node "
                             "(zeropp.split_dp_by_node(mesh) before mesh.groups())")
        return cls(tuple(options), groups.more.get("dp_intra"), groups.more.get("dp_cross"), groups.dp)

    def prepare(self, bucket) -> None:  # bucket: a ShardedBucket, given hpZ's attributes
        """hpZ: the bucket's second shard, place j of K on the node keeping elements [j P/K, (j+1) P/K)."""
        check_split(self.options, None if bucket.group is self.dp else f"the parameters of {bucket.group.name}")
        if self.hpz:
            k, j = self.intra.size, self.intra.rank
            bucket.node_slice = slice(j * bucket.padded // k, (j + 1) * bucket.padded // k)
            bucket.secondary = torch.zeros(bucket.padded // k, dtype=bucket.full.dtype, device=bucket.full.device)

    def gather_forward(self, bucket):
        # qwZ: int8 codes and scales, dequantized on arrival; hpZ: the arrival fills the node's copy
        work = QuantizedGather(bucket.full.data, bucket.shard, bucket.group, self.weight_bits, self.block) \
            if self.qwz else self.gather_exact(bucket)
        return KeepNodeCopy(work, bucket) if self.hpz else work

    def gather_backward(self, bucket):
        if self.hpz:  # hpZ: from the node's copy, over the node: K x [P/K]
            return all_gather_into(bucket.full.data, bucket.secondary, self.intra, async_op=True)
        return self.gather_exact(bucket)

    def reduce_scatter(self, bucket: ShardedBucket, flat: torch.Tensor) -> torch.Tensor:
        if not self.qgz:
            return super().reduce_scatter(bucket, flat)
        return quantized_reduce_scatter(flat, self.intra, self.cross, self.grad_bits, self.block)

    def held(self, bucket) -> list[torch.Tensor]:
        return [bucket.secondary] if self.hpz else []


# -- The wire format: codes, then scales, as one byte tensor --------------------------------------


def wire_bytes(numel: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of `numel` numbers sent at `bits` bits: the codes (no padding) and an fp32 scale a block."""
    return math.ceil(numel * bits / 8) + 4 * math.ceil(numel / block)


def pack(x: torch.Tensor, bits: int, block: int = BLOCK) -> torch.Tensor:
    """x -> uint8 [wire_bytes]: its codes, then its scales. A block holding inf or nan gets a nan
    scale, so the sum it joins is nan and the step is skipped on every rank (zero.clip_and_step)."""
    flat = x.detach().reshape(-1)
    finite = torch.isfinite(flat)
    codes, scales = quantize(torch.where(finite, flat, 0), block, bits)  # [blocks, block * bits/8], [blocks]
    if not finite.all():
        bad = ~torch.nn.functional.pad(finite, (0, -flat.numel() % block), value=True).view(-1, block).all(1)
        scales = scales.masked_fill(bad, math.nan)
    code_bytes = codes.reshape(-1).view(torch.uint8)[: math.ceil(flat.numel() * bits / 8)]  # padding stays home
    return torch.cat([code_bytes, scales.view(torch.uint8)])


def unpack(wire: torch.Tensor, numel: int, bits: int, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """pack's bytes -> the [numel] numbers they stand for, in `dtype`."""
    blocks, code_len = math.ceil(numel / block), math.ceil(numel * bits / 8)
    codes = torch.nn.functional.pad(wire[:code_len], (0, blocks * block * bits // 8 - code_len))
    codes = codes.view(torch.int8 if bits == 8 else torch.uint8).view(blocks, -1)  # [blocks, block * bits/8]
    scales = wire[code_len:].clone().view(torch.float32)  # [blocks]; cloned: a view needs aligned bytes
    return dequantize(codes, scales, bits, (numel,), dtype)


# -- qwZ: the forward all-gather in int8 -----------------------------------------------------------


@dataclass
class KeepNodeCopy:
    """hpZ: a forward gather in flight; on arrival its node's slice is kept for backward's gather."""

    work: Any
    bucket: Any  # a ShardedBucket that prepare gave hpZ's secondary shard and node_slice

    def wait(self) -> None:
        self.work.wait()
        self.bucket.secondary.copy_(self.bucket.full.data[self.bucket.node_slice])


class QuantizedGather:
    """An all-gather of each rank's packed shard, in flight; wait() dequantizes every rank's piece
    into `full` (the bucket's flat [padded] buffer, rank r's piece at r * s)."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, group: Group, bits: int, block: int = BLOCK):
        self.full, self.numel, self.bits, self.block, self.n = full, shard.numel(), bits, block, group.size
        mine = pack(shard, bits, block)  # [q] uint8
        self.wire = torch.empty(self.n * mine.numel(), dtype=torch.uint8, device=shard.device)  # [N q]
        self.work = all_gather_into(self.wire, mine, group, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        for r, piece in enumerate(self.wire.chunk(self.n)):
            self.full[r * self.numel:(r + 1) * self.numel] = unpack(piece, self.numel, self.bits, self.full.dtype,
                                                                    self.block)


# -- qgZ: the reduce-scatter as two quantized all-to-alls ------------------------------------------


def quantized_exchange(rows: torch.Tensor, group: Group, bits: int, dtype: torch.dtype,
                       block: int = BLOCK) -> torch.Tensor:
    """rows [n, L]: row j goes to group rank j, quantized; returns the sum, in `dtype`, of the rows
    this rank receives (one from every rank, its own included), each dequantized first. [L]"""
    n, length = rows.shape
    wire = torch.stack([pack(row, bits, block) for row in rows])  # [n, q] uint8
    received = all_to_all(wire, group)  # [n, q]: row i came from group rank i
    return sum((unpack(piece, length, bits, dtype, block) for piece in received),
               torch.zeros(length, dtype=dtype, device=rows.device))


def quantized_reduce_scatter(flat: torch.Tensor, intra: Group, cross: Group, bits: int,
                             block: int = BLOCK) -> torch.Tensor:
    """[P] on each of N = M x K dp ranks -> this rank's [P/N] of the sum: the slice of dp rank
    d = cross.rank * K + intra.rank, as reduce_scatter over dp leaves it; summed in fp32 or wider."""
    k, m = intra.size, cross.size
    s = flat.numel() // (k * m)
    wide = torch.promote_types(flat.dtype, torch.float32)
    # Hop 1: row j holds the slices of the dp ranks at place j on every node ([m, k, s] -> [k, m s]).
    by_place = flat.view(m, k, s).transpose(0, 1).reshape(k, m * s)
    node_sum = quantized_exchange(by_place, intra, bits, wide, block)  # [m s]: my place's slices, summed over my node
    # Hop 2: slice i goes to my peer on node i; what comes back is my own slice from every node.
    return quantized_exchange(node_sum.view(m, s), cross, bits, wide, block)  # [s]
