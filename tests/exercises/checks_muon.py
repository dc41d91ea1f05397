"""Chapter 4c's exercises: Muon's owner step (4c.1, on gloo ranks) and the bytes Muon's gather adds (4c.2)."""

from __future__ import annotations

import math

import torch
from check_common import LAYOUTS, Predict, attempt, guarded, number_problems, on_ranks, where, world_group

# 4c.1: a flat vector of these matrices one after another, padded with zeros to a multiple of N
MiB = 2**20
SHAPES = [(8, 4), (6, 6), (4, 10), (5, 3), (12, 2), (3, 9)]
OWNER_OFF = ("minipar.muon:Muon.owner_pieces", "minipar.muon:Muon.pieces")


def layout(n: int) -> tuple[list[int], int]:
    sizes = [math.prod(s) for s in SHAPES]
    return [sum(sizes[:i]) for i in range(len(sizes))], -(-sum(sizes) // n) * n


def held(offset: int, numel: int, r: int, per: int) -> int:
    """How many numbers of a matrix at `offset` lie in rank r's slice."""
    return max(0, min(offset + numel, (r + 1) * per) - max(offset, r * per))


def owner_bytes(n: int, me: int, owner: list[int]) -> int:
    """What rank `me` sends: its slice's part of each matrix another rank owns (there), and to each other
    rank the part of its slice of each matrix it owns (back), 2 bytes a number (bf16)."""
    offsets, padded = layout(n)
    per, sizes = padded // n, [math.prod(s) for s in SHAPES]
    there = sum(held(o, s, me, per) for o, s, w in zip(offsets, sizes, owner) if w != me)
    back = sum(s - held(o, s, me, per) for o, s, w in zip(offsets, sizes, owner) if w == me)
    return 2 * (there + back)


def _owner_rank(rank, world, student, group_size):
    from minipar.muon import newton_schulz, ns_flops, owners

    group = world_group("dp", group_size)
    n, at = group.size, where(rank, world, group, "dp")
    offsets, padded = layout(n)
    flat = torch.randn(padded, generator=torch.Generator().manual_seed(40 + group.ranks[0]), dtype=torch.float64)
    flat[sum(math.prod(s) for s in SHAPES):] = 0  # the padding
    owner = owners([ns_flops(s, 5) for s in SHAPES], n)
    want = torch.zeros(padded, dtype=torch.float64)
    for o, shape in zip(offsets, SHAPES):
        whole = flat[o : o + math.prod(shape)].view(shape)
        want[o : o + math.prod(shape)] = newton_schulz(whole, 5).double().reshape(-1)
    per = padded // n
    mine = slice(group.rank * per, (group.rank + 1) * per)
    got = attempt(student.owner_step, flat[mine].clone(), SHAPES, owner, group)
    if not torch.is_tensor(got) or got.shape != (per,) or not torch.equal(got.double(), want[mine]):
        diff = (got.double() - want[mine]).abs().max().item() if torch.is_tensor(got) and got.shape == (per,) else None
        return {"problems": [f"{at}: this rank's slice of the orthogonalised matrices differs from one device's "
                             f"(Newton-Schulz of each whole matrix): " + (f"max abs diff {diff:.3g}" if diff is not None
                                                                          else f"got {getattr(got, 'shape', got)}")]}
    seen = {op: e for (_, op), e in group.ledger.entries.items()}
    want_sent = owner_bytes(n, group.rank, owner)
    pattern = {op: e.calls for op, e in seen.items()}
    sent = sum(e.sent for e in seen.values())
    if pattern != {"all_to_all": 2} or sent != want_sent:
        shown = ", ".join(f"{op} x{e.calls} ({e.sent} bytes sent)" for op, e in sorted(seen.items())) or "nothing"
        return {"problems": [f"{at}: the ledger shows {shown}; expected two all_to_all (each matrix's parts to its "
                             f"owner, then each rank's part back), {want_sent} bytes sent in bf16 (2 bytes a number)"
                             + (": gathering everything to everyone sends each rank every matrix, and repeats "
                                "Newton-Schulz on each" if "all_gather" in seen else "")]}
    return {"problems": []}


_owner_rank_guarded = guarded(_owner_rank, OWNER_OFF)


def check_owner_step(path, run_ranks) -> list[str]:
    return on_ranks(_owner_rank_guarded, path, run_ranks, LAYOUTS)


# 4c.2: what --muon-method gather adds under ZeRO-1, buckets small enough that every one is cut
# small at dp 2 and 3: some slices end between matrices; small at 6 and 125m at 2: their keys are printed in docs/
GATHER_SPACE = [dict(model=m, dp=dp) for m in ("small", "125m") for dp in (2, 3, 5, 6, 8)
                if (m, dp) not in (("small", 2), ("small", 3), ("small", 6), ("125m", 2))]


def truth_gather_bytes(model: str, dp: int) -> int:
    from minipar.model import get_config
    from minipar.planning.estimate import rank_model, zero_buckets
    from minipar.planning.estimate_muon import muon_messages
    from minipar.run.config import TrainConfig

    cfg = TrainConfig(model=model, dp=dp, zero=1, optimizer="muon", precision="fp32", bucket_mb=0.25,
                      global_batch=dp * 8)
    paper = rank_model(get_config(model), cfg)
    return sum(b for _, b in muon_messages(paper, cfg, zero_buckets(paper, cfg)))


check_predict_gather_bytes = Predict(
    GATHER_SPACE,
    lambda v: f"the {v['model']} model in fp32 with --optimizer muon over {v['dp']} data-parallel ranks, ZeRO-1, "
              f"--muon-method gather, --bucket-mb 0.25: how many MiB does one rank send a step beyond what ZeRO-1 "
              f"sends for AdamW?",
    lambda answer, v: number_problems(answer, truth_gather_bytes(v["model"], v["dp"]) / MiB, 0.02,
                                      f"what Muon's gather adds per rank and step, in MiB (the {v['model']} model, "
                                      f"dp {v['dp']})", "the estimator's estimate_muon, equal to the ledger's"),
    lambda v: [f"{truth_gather_bytes(v['model'], v['dp']):,}",
               f"{truth_gather_bytes(v['model'], v['dp']) / MiB:.2f} MiB"])
