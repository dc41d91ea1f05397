"""Step 3b: mixed precision under ZeRO: the paper's (2 + 2 + 12) Psi, held byte for byte, and what
fp32 gradients on the wire cost.

    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_03b_mixed_precision.py   (2 works too)

All ranks form one dp group. The small Llama (seed 0), in `--precision bf16-mixed`: the wrapper
(build_grad_sync) keeps fp32 master weights and AdamW's fp32 moments (ZeRO: this rank's slices) and
turns the model's own weights into bf16 working copies; gradients are bf16. One AdamW step per stage
(so the moments exist), then one more backward, and a look at every tensor the rank holds:

(a) bytes per rank at the end of backward, by what they are (bf16 weights, bf16 gradients, fp32
    master, fp32 m and v), each storage counted once, next to the ZeRO paper's
    2 Psi + 2 Psi + 12 Psi divided as each stage divides it (Psi': padded so each bucket splits in N);
(b) the bytes each rank sends in that step (the mesh ledger) with --grad-reduce bf16 and fp32: fp32
    sends the gradients at twice the width and buys one rounding of the sum instead of N - 1
    (tests/test_mixed_precision.py measures that against the exact mean).

Chapter: docs/03b_mixed_precision.md. The loss curves: scripts/tools/plot_precision.py.
"""

from functools import partial

import torch
import torch.distributed as dist
from course_common import each_rank, finish, leave, say, start_gloo

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw, build_grad_sync
from minipar.precision import resolve
from minipar.run.config import TrainConfig
from minipar.run.train import train_step

CFG = get_config("small")
OPT = TrainConfig()  # lr 3e-3, weight decay 0.1 on matrices, as scripts/train.py
ROWS, SEQ, BUCKET_MB = 8, 128, 0.5
KINDS = ("bf16 weights", "bf16 grads", "fp32 master", "fp32 m + v")


def my_rows(mesh: Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(100))
    per, r = ROWS // mesh.groups().dp.size, mesh.groups().dp.rank
    return x[r * per : (r + 1) * per], torch.roll(x, -1, dims=1)[r * per : (r + 1) * per]  # [B/N, s]


def held(wrapper) -> dict[str, int]:
    """Bytes of every storage the rank holds, by kind, each storage once. The weights: the model's
    parameters (ZeRO-3: freed, 0 bytes, between uses) and ZeRO-3's bf16 shards; the gradients: the
    .grad tensors and ZeRO's gradient slices; the masters and moments: what AdamW steps and keeps."""
    buckets = getattr(wrapper, "buckets", [])
    tensors = {"bf16 weights": [*wrapper.module.parameters(), *(getattr(b, "shard", None) for b in buckets)],
               "bf16 grads": [*(p.grad for p in wrapper.module.parameters()), *(getattr(b, "grad_slice", None)
                                                                               for b in buckets)],
               "fp32 master": [m for g in wrapper.optimizer.param_groups for m in g["params"]],
               "fp32 m + v": [t for s in wrapper.optimizer.state.values() for t in s.values() if t.dim()]}
    seen, out = set(), {}
    for kind, ts in tensors.items():
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts if t is not None}
        out[kind] = sum(n for ptr, n in storages.items() if ptr not in seen)
        seen |= storages.keys()
    return out


def paper(stage: int, psi: int, padded: int, n: int) -> dict[str, int]:
    """2 + 2 + 12 bytes per parameter; a sharded kind holds 1/N of the padded Psi' (and stages 1-2
    keep their whole weights in the padded flat vectors they all-gather into: 2 Psi')."""
    def per_rank(width: int, sharded_from: int) -> int:
        return width * padded // n if stage >= sharded_from else width * psi
    weights = 2 * padded if stage in (1, 2) else per_rank(2, 3)
    return dict(zip(KINDS, (weights, per_rank(2, 2), per_rank(4, 1), per_rank(8, 1))))


def measure(mesh: Mesh, stage: int, grad_reduce: str) -> dict:
    """One step (AdamW's moments appear), then the next step's backward: what is held, what was sent."""
    model = Llama(CFG, seed=0)  # fp32: the wrapper takes these as its masters
    wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, OPT), partial(adamw, lr=OPT.lr),
                              zero=stage, bucket_mb=BUCKET_MB,
                              precision=resolve("bf16-mixed", grad_reduce=grad_reduce))
    x, y = my_rows(mesh)
    train_step(wrapper, [(x, y)], grad_clip=1.0)
    mesh.ledger.reset()
    wrapper(x, y).backward()
    now = held(wrapper)
    wrapper.finish_grad_sync()
    wrapper.clip_and_step(1.0)
    padded = sum(b.padded for b in wrapper.buckets) if stage else CFG.num_params()
    return dict(held=now, padded=padded, buffers=sum(b.buffer.numel() * b.buffer.element_size()
                                                     for b in wrapper.buckets if stage == 0 and b.buffer is not None),
                sent=mesh.ledger.total_sent())


def part_a(mesh: Mesh, results: dict) -> None:
    n, psi = mesh.groups().dp.size, CFG.num_params()
    say(f"small Llama, bf16-mixed: Psi = {psi:,} parameters; dp = N = {n}; stage 0-2 buckets of {BUCKET_MB} MiB")
    say("\n(a) what each rank holds at the end of backward, bytes")
    say(f"  {'':<22}" + "".join(f"{k:>14}" for k in KINDS) + f"{'total':>14}")
    for stage in range(4):
        r = results[stage, "bf16"]
        formula = paper(stage, psi, r["padded"], n)
        say(f"stage {stage}" + (f"   (Psi' = {r['padded']:,})" if stage else ""))
        say(f"  {'paper (2+2+12) Psi':<22}" + "".join(f"{v:>14,}" for v in formula.values())
            + f"{sum(formula.values()):>14,}")
        each_rank("", f"{'measured':<14}" + "".join(f"{r['held'][k]:>14,}" for k in KINDS)
                      + f"{sum(r['held'].values()):>14,}" + ("  equal" if r["held"] == formula else "  DIFFERS"))
        if stage == 0:
            each_rank("  besides: DataParallel's flat bf16 all-reduce buffers, kept between steps",
                      f"{r['buffers']:,} bytes")


def part_b(mesh: Mesh, results: dict) -> None:
    n = mesh.groups().dp.size
    say("\n(b) bytes each rank sends in one step, by --grad-reduce")
    say(f"  {'stage':<8}{'bf16':>14}{'fp32':>14}{'fp32 / bf16':>14}")
    for stage in range(4):
        bf16, fp32 = results[stage, "bf16"]["sent"], results[stage, "fp32"]["sent"]
        say(f"  {stage:<8}{bf16:>14,}{fp32:>14,}{fp32 / bf16:>14.3f}")
    say(f"  (N = {n}) stage 0 sends only gradients: 2x; stages 1-2 a gradient reduce-scatter and a bf16\n"
        "  weight all-gather: (4 + 2) / (2 + 2) = 1.5x; stage 3 gathers the bf16 weights twice: 8 / 6 = 1.33x")


def main() -> None:
    start_gloo()
    mesh = Mesh.build(dp=dist.get_world_size())
    if ROWS % mesh.groups().dp.size:
        raise SystemExit(f"{ROWS} rows do not split into {mesh.groups().dp.size} ranks")
    results = {(stage, how): measure(mesh, stage, how) for stage in range(4) for how in ("bf16", "fp32")}
    part_a(mesh, results)
    part_b(mesh, results)
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
