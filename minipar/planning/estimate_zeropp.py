"""ZeRO++'s figures before anything runs: hpZ's memory, and the bytes each rank sends per step.

zeropp.py's table, per unit of P (padded) numbers over N = M x K dp ranks, s = P / N, each per micro-batch:

    hpZ memory          P / K numbers a unit, in the working dtype (bf16 under bf16-mixed)
    dp/all_gather       forward (N-1) s w, or qwZ (N-1) q_8(s); backward (N-1) s w unless hpZ
    dp_intra/all_gather hpZ: (K-1) P/K w
    dp/reduce_scatter   (N-1) s g, or qgZ's dp_intra (K-1) q_4(M s) and dp_cross (M-1) q_4(s) all-to-alls
"""

from __future__ import annotations

from minipar.mesh import MeshLayout
from minipar.zeropp import ZeroPP, dp_per_node, parse, wire_bytes


def _split(cfg) -> tuple[ZeroPP, int, int]:
    """(the options, K: dp ranks a node, M: nodes a dp group spans) of a Layout (layout.py)."""
    plus = ZeroPP(parse(cfg.zeropp) if cfg.zeropp else ())
    layout = MeshLayout(cfg.dp * cfg.tp * cfg.pp * cfg.cp, dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp,
                        ranks_per_node=cfg.ranks_per_node)
    k = dp_per_node(layout) if plus.hpz or plus.qgz else cfg.dp
    return plus, k, cfg.dp // k


def secondary_bytes(plan, cfg, width: int) -> int:
    """hpZ's node-local copy: P / K numbers of `width` bytes for each ZeRO-3 bucket of `plan`; 0 without."""
    plus, k, _ = _split(cfg)
    if not plus.hpz:
        return 0
    padded = [-(-sum(p.numel() for p in chunk) // cfg.dp) * cfg.dp for _, _, chunk in plan]
    return sum(p // k * width for p in padded)


def bucket_messages(padded: int, cfg, width: int, wire: int) -> list[tuple[str, int]]:
    """One rank's messages for a ZeRO-3 bucket of `padded` numbers a micro-batch: two gathers, the gradients'."""
    plus, k, m = _split(cfg)
    n, s = cfg.dp, padded // cfg.dp
    sent = [("dp/all_gather", (n - 1) * (wire_bytes(s, plus.weight_bits, plus.block) if plus.qwz else s * width))]
    if plus.hpz:  # backward's gather: from the node's secondary copy
        sent.append(("dp_intra/all_gather", (k - 1) * padded // k * width))
    else:
        sent.append(("dp/all_gather", (n - 1) * s * width))
    if plus.qgz:
        return sent + [("dp_intra/all_to_all", (k - 1) * wire_bytes(m * s, plus.grad_bits, plus.block)),
                       ("dp_cross/all_to_all", (m - 1) * wire_bytes(s, plus.grad_bits, plus.block))]
    return sent + [("dp/reduce_scatter", (n - 1) * s * wire)]
