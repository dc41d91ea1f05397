"""Step 3c: ZeRO++ on ZeRO-3: one quantized message, the bytes each link carries, hpZ's memory.

    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_03c_zero_plus_plus.py   (--ranks-per-node 2)

The 4 ranks form one dp group laid over 2 simulated nodes of 2 (`--ranks-per-node`: node = rank // 2,
as torchrun numbers a real node's ranks), so the ledger can say which bytes would leave a node. The
small Llama (seed 0) in bf16-mixed under ZeRO-3, trained STEPS steps on the same batches five times:
plain, each of --zeropp's three options alone, and all three (zeropp.py explains them):

(a) one message of qwZ, the first forward's: the first numbers of rank 0's bf16 shard of one unit
    (the initial weights, the same on any CPU), their int8 codes, the block's scale, the numbers
    dequantized, and the error against its bound, scale / 2;
(b) the bytes of the last step, all ranks together, by link: inside a node and across nodes;
(c) what hpZ holds for it: a second copy of every unit, 1/K of it (K = 2 dp ranks a node), in bf16;
(d) the loss after STEPS steps, against plain ZeRO-3's: how far each option moves it (trained bf16
    weights differ in their last bits from one CPU's kernels to another's, so the loss is shown to
    2 decimals and each difference by the power of ten it stays under).

Chapter: docs/03c_zero_plus_plus.md. Tests: tests/test_zeropp.py.
"""

import argparse
from functools import partial

import torch
import torch.distributed as dist
from course_common import finish, leave, say, start_gloo, to_rank0

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw, build_grad_sync
from minipar.precision import resolve
from minipar.quantize import dequantize, quantize
from minipar.run.config import TrainConfig
from minipar.run.train import train_step
from minipar.zeropp import BLOCK, split_dp_by_node, wire_bytes

CFG = get_config("small")
OPT = TrainConfig()  # lr 3e-3, weight decay 0.1 on matrices, as scripts/train.py
ROWS, SEQ, STEPS = 2, 64, 3
OPTION_SETS = [(), ("qwz",), ("hpz",), ("qgz",), ("qwz", "hpz", "qgz")]


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train(mesh: Mesh, options: tuple[str, ...]) -> dict:
    model = Llama(CFG, seed=0)
    z = build_grad_sync(model, mesh.groups(), param_groups(model, OPT), partial(adamw, lr=OPT.lr), zero=3,
                        precision=resolve("bf16-mixed"), zeropp=options)
    first = max(z.buckets, key=lambda b: b.padded).shard.clone()  # what the first forward's gather sends
    for step in range(STEPS):
        mesh.ledger.reset()  # keep the last step's bytes
        loss, _ = train_step(z, [batch(step, mesh.rank)], grad_clip=1.0)
    sent = mesh.ledger.snapshot()
    moved = [e for k, e in sent.items() if not k.endswith("all_reduce")]  # the norm's scalars aside
    losses = to_rank0(loss)
    secondary = sum(t.numel() * 2 for b in z.buckets for t in b.transport.held(b))  # hpZ's node-local copies
    return dict(intra=sum(e["intra"] for e in moved), cross=sum(e["cross"] for e in moved),
                loss=None if losses is None else sum(losses) / len(losses), params=z.param_bytes(),
                secondary=secondary, padded=sum(b.padded for b in z.buckets), z=z, first=first)


def show_message(z, shard: torch.Tensor) -> None:
    """(a): rank 0's shard of the largest bucket (the embedding) before training, as qwZ sends it."""
    bucket = max(z.buckets, key=lambda b: b.padded)
    name = next(n for n, p in z.module.named_parameters() if p is bucket.params[0])
    codes, scales = quantize(shard, BLOCK, 8)
    back = dequantize(codes, scales, 8, shard.shape, torch.float32)
    say(f"(a) qwZ: rank 0's shard of {name}, {shard.numel():,} bf16 numbers = {2 * shard.numel():,} bytes, "
        f"sent as {wire_bytes(shard.numel(), 8):,} (int8 codes + one fp32 scale per {BLOCK})")
    say(f"    block 0's scale = max|x| / 127 = {scales[0].item():.6e}; its first numbers:")
    say(f"    {'x (bf16)':>12}{'code':>6}{'code x scale':>14}{'|error|':>11}")
    for v, c, d in zip(shard[:6].float(), codes[0, :6], back[:6]):
        say(f"    {v.item():>12.6f}{c.item():>6}{d.item():>14.6f}{abs(v - d).item():>11.2e}")
    errors = torch.nn.functional.pad((shard.float() - back).abs(), (0, -shard.numel() % BLOCK)).view(-1, BLOCK)
    worst = (errors.amax(1) / (scales / 2)).max()
    say(f"    bound: scale / 2 = {scales[0].item() / 2:.2e} in block 0; every block's worst error is "
        f"{worst.item():.2f} of its bound")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks-per-node", type=int, default=2, help="simulated ranks per node (node = rank // K)")
    k = p.parse_args().ranks_per_node
    start_gloo()
    mesh = Mesh.build(dp=dist.get_world_size(), ranks_per_node=k)
    split_dp_by_node(mesh)  # dp_intra {0,1} {2,3}, dp_cross {0,2} {1,3}
    say(mesh.layout.table())
    runs = {options: train(mesh, options) for options in OPTION_SETS}
    show_message(runs[()]["z"], runs[()]["first"])
    totals = to_rank0({o: (r["intra"], r["cross"]) for o, r in runs.items()})
    if totals is not None:  # rank 0
        show_bytes_memory_loss(runs, totals, k)
    finish(mesh)


def show_bytes_memory_loss(runs: dict, totals: list[dict], k: int) -> None:
    """(b), (c), (d), on rank 0."""
    across = sum(t[()][1] for t in totals)
    print(f"(b) bytes of one step (forward and backward gathers, gradients), {len(totals)} ranks together:")
    print(f"    {'':<14}{'intra-node':>14}{'cross-node':>14}{'cross vs plain':>16}")
    for o in OPTION_SETS:
        intra, cross = (sum(t[o][i] for t in totals) for i in (0, 1))
        print(f"    {','.join(o) or 'plain ZeRO-3':<14}{intra:>14,}{cross:>14,}{across / cross:>15.2f}x")
    plain, hpz = runs[()], runs[("hpz",)]
    print(f"(c) hpZ on rank 0: a second copy of each unit, 1/{k} of it in bf16: {hpz['secondary']:,} bytes "
          f"= {hpz['padded']:,} numbers / {k} x 2;")
    print(f"    the wrapper's param_bytes {plain['params']:,} -> {hpz['params']:,} "
          f"(+{hpz['params'] - plain['params']:,})")
    print(f"(d) loss after {STEPS} steps (mean over the ranks' batches): plain ZeRO-3 {plain['loss']:.2f}")
    for o in OPTION_SETS[1:]:
        moved = abs(runs[o]["loss"] - plain["loss"])
        under = next(10.0 ** -k for k in range(6, -1, -1) if moved < 10.0 ** -k)  # the first power of ten above
        print(f"    {','.join(o):<14}" + ("the same loss, bit for bit" if moved == 0 else f"within {under:g} of plain"))


if __name__ == "__main__":
    main()
    leave()
