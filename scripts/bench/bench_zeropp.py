"""Benchmark: ZeRO++'s options on minipar's ZeRO-3, one row each: bytes per step by link, step time, loss.

    torchrun --standalone --nproc-per-node 4 scripts/bench/bench_zeropp.py --ranks-per-node 2   # CPU, 2 simulated nodes
    torchrun --nproc-per-node 8 scripts/bench/bench_zeropp.py --model 125m --json zeropp.json   # a GPU node (NCCL)

One launch trains five copies of the same model side by side, in bf16-mixed under ZeRO-3: plain,
--zeropp qwz, hpz, qgz alone, and all three, each built by build_grad_sync and stepped by train_step
in turn on the same random batches (bench_common.take_turns), after `--warmup` unmeasured steps.
Rank 0 prints one row per side: the bytes of one step summed over the ranks (the ledger, split by
intra- and cross-node link as collectives.py counts them), the median step time (the slowest rank's),
and the loss after the last step against plain ZeRO-3's.

On CPU with gloo, the "nodes" are simulated (`--ranks-per-node`) and every byte takes the same path
through the loopback: the step times show what quantizing costs in compute, not what it saves on a
network. The bytes are the point; on a real cluster the cross-node ones are the slow ones.
"""

from __future__ import annotations

from functools import partial

import torch
from bench_common import (
    across_ranks,
    command_line,
    finish,
    machine,
    parse,
    rank_micro_batches,
    step_stats,
    take_turns,
    threads_per_rank,
    world_size,
    write_json,
)

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.ops.hang import start_distributed
from minipar.parallelize import adamw, build_grad_sync
from minipar.precision import resolve
from minipar.run.config import TrainConfig
from minipar.run.train import train_step
from minipar.zeropp import split_dp_by_node

SIDES = {"plain ZeRO-3": (), "qwz": ("qwz",), "hpz": ("hpz",), "qgz": ("qgz",), "qwz,hpz,qgz": ("qwz", "hpz", "qgz")}


def main(argv=None) -> None:
    p = command_line(__doc__, "five sides", steps=10, warmup=2)
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks a node (simulated on one machine)")
    p.add_argument("--micro-batch", type=int, default=2)
    args = parse(p, argv)
    world = world_size()
    torch.set_num_threads(threads_per_rank())
    device = start_distributed(timeout=600.0)
    mesh = Mesh.build(dp=world, ranks_per_node=args.ranks_per_node)
    split_dp_by_node(mesh)
    config = get_config(args.model)
    cfg = TrainConfig(model=args.model, dp=world, seq_len=args.seq_len, micro_batch=args.micro_batch,
                      global_batch=world * args.micro_batch, seed=args.seed)
    steps, bytes_of = {}, {}
    for side, options in SIDES.items():
        model = Llama(config, seed=args.seed).to(device)
        z = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr), zero=3,
                            precision=resolve("bf16-mixed"), zeropp=options)
        steps[side] = lambda micro, z=z: train_step(z, micro, cfg.grad_clip)

    def after(side, measured):  # the last step's bytes, moved weights and gradients (the norm's scalars aside)
        moved = [e for k, e in mesh.ledger.snapshot().items() if not k.endswith("all_reduce")]
        bytes_of[side] = [sum(e["intra"] for e in moved), sum(e["cross"] for e in moved)]

    times, losses = take_turns(steps, lambda s: (rank_micro_batches(s, cfg, config.vocab_size, mesh.rank, device),),
                               args.warmup, args.steps, device, mesh.ledger, after)
    rows = {}
    for side in SIDES:
        slowest = across_ranks(times[side], mesh.groups().dp, device).tolist()
        intra, cross = across_ranks(bytes_of[side], mesh.groups().dp, device, op="sum").tolist()
        loss = float(across_ranks([losses[side][-1]], mesh.groups().dp, device, op="sum")[0]) / world
        rows[side] = {"intra_bytes": int(intra), "cross_bytes": int(cross), "loss": loss, **step_stats(slowest)}
    if mesh.rank == 0:
        plain = rows["plain ZeRO-3"]
        print(f"{args.model}, dp {world} on {world // args.ranks_per_node} nodes of {args.ranks_per_node}, "
              f"bf16-mixed, {args.steps} steps after {args.warmup}; bytes of one step, all ranks:")
        print(f"{'':<14}{'intra-node':>14}{'cross-node':>14}{'cross vs plain':>16}{'step':>10}{'loss':>10}"
              f"{'vs plain':>11}")
        for side, r in rows.items():
            print(f"{side:<14}{r['intra_bytes']:>14,}{r['cross_bytes']:>14,}"
                  f"{plain['cross_bytes'] / r['cross_bytes']:>15.2f}x{r['median_step_s'] * 1e3:>8.0f}ms"
                  f"{r['loss']:>10.4f}{r['loss'] - plain['loss']:>+11.4f}")
        write_json(args.json, {"machine": machine(device), "args": vars(args), "sides": rows})
    finish(mesh)


if __name__ == "__main__":
    main()
