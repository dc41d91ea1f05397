"""Benchmark: minipar's hand-written DataParallel against PyTorch's DistributedDataParallel.

    torchrun --nproc-per-node 2 scripts/bench/bench_dp.py                   # about a minute on 2 CPU cores
    torchrun --nproc-per-node 2 scripts/bench/bench_dp.py --micro-batch 2   # gradient accumulation, 4 per step
    torchrun --nproc-per-node 8 scripts/bench/bench_dp.py --model 125m --json dp.json   # a GPU node (NCCL)

One launch trains two copies of the same model side by side, on every rank:

    (a) minipar   DataParallel(model, mesh.groups(), optimizer=...)   step: minipar.run.train.train_step
    (b) PyTorch   DistributedDataParallel(copy of model)              step: the same train_step

Both start from the same weights (Llama(config, seed)), see the same random token batches in the
same order, and step with the same AdamW (parallelize.adamw on param_groups of one TrainConfig,
held by each side's wrapper), the same gradient clipping (minipar.data_parallel.clip_grads) and the same
accumulation: all micro-batches but the last inside `no_sync()`. They run
in turn, step by step (a b, b a, a b, ...: machine noise and any penalty for going first or second
hit both alike), after `--warmup` unmeasured steps each. Each optimizer step is timed with
time.perf_counter (after torch.cuda.synchronize on GPUs), starting from a barrier so that both
ranks begin together; a step's time is the slowest rank's.

Rank 0 prints the median step time of each, tokens per second, the ratio minipar / DDP (the goal
is <= 1.0x), and the bytes minipar's ledger says one rank sent per step. It also prints the
largest difference between the two models' parameters at the end: they did the same arithmetic,
so they must agree to float32 rounding. A larger difference would mean the two sides did not do
the same work, and the timings would compare nothing.

Backend: NCCL and the local GPU when CUDA is available, else gloo on CPU, with torch threads set
to the cores per rank (1 for 2 ranks on 2 cores: more threads only contend).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import bench_common as bench
import torch
import torch.distributed as dist

from minipar.data_parallel import DataParallel, param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.train import train_step


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.command_line(__doc__, "two", steps=100, warmup=5)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward on one rank")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size, both sides")
    return bench.parse(p, argv)


def check_counts(args) -> None:
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps must be at least 1 and --warmup at least 0")


def build_sides(cfg: TrainConfig, model_cfg, mesh: Mesh, device) -> dict:
    """Both models from the same weights, each wrapper holding an AdamW of its own from the same
    TrainConfig; {side: wrapper}."""
    mine, copy = (Llama(model_cfg, seed=cfg.seed).to(device) for _ in range(2))
    ours = DataParallel(mine, mesh.groups(), bucket_mb=cfg.bucket_mb, optimizer=adamw(param_groups(mine, cfg), cfg.lr))
    theirs = bench.TorchDDP(copy, adamw(param_groups(copy, cfg), cfg.lr), mesh.groups().dp, bucket_cap_mb=cfg.bucket_mb,
                            device_ids=[device.index] if device.type == "cuda" else None)
    return {"minipar": ours, "ddp": theirs}


def run_steps(sides: dict, args, cfg: TrainConfig, vocab: int, mesh: Mesh, device) -> dict:
    """Both sides in turn, the same train_step on the same batches. Returns this rank's measured
    step times and the losses of every step, per side, and minipar's bytes sent per measured step."""
    traffic = {"sent": [], "ledger": {}}

    def note(side: str, measured: bool) -> None:  # right after each step: its entries in the ledger
        if measured and side == "minipar":
            traffic["sent"].append(mesh.ledger.total_sent())
            traffic["ledger"] = mesh.ledger.snapshot()

    def batch(step: int) -> tuple:
        return (bench.rank_micro_batches(step, cfg, vocab, mesh.coord("dp"), device),)

    steps = {name: partial(train_step, model, grad_clip=cfg.grad_clip) for name, model in sides.items()}
    times, losses = bench.take_turns(steps, batch, args.warmup, args.steps, device, mesh.ledger, note)
    return {"times": times, "losses": losses} | traffic


def summarise(run: dict, sides: dict, args, cfg: TrainConfig, mesh: Mesh, device) -> dict:
    """The results on every rank: the slowest rank's step times, and how far the two models ended apart."""
    ours, theirs = sides["minipar"], sides["ddp"]
    step_times = bench.across_ranks([run["times"]["minipar"], run["times"]["ddp"]], mesh.groups().dp, device)
    with torch.no_grad():
        param_diff = max((p - q).abs().max().item()
                         for p, q in zip(ours.module.parameters(), theirs.module.parameters(), strict=True))
    loss_diff = max(abs(a - b) for a, b in zip(run["losses"]["minipar"], run["losses"]["ddp"], strict=True))
    tokens_per_step = cfg.global_batch * cfg.seq_len
    results = {
        "model": cfg.model, "params": sum(p.numel() for p in ours.module.parameters()), "world": mesh.groups().dp.size,
        **bench.machine(device),
        "steps": args.steps, "warmup": args.warmup, "global_batch": cfg.global_batch,
        "micro_batch": cfg.micro_batch, "accum_steps": cfg.accum_steps, "seq_len": cfg.seq_len,
        "bucket_mb": cfg.bucket_mb, "minipar_buckets": len(ours.buckets),
        "bytes_sent_per_step": statistics.median(run["sent"]), "ledger": run["ledger"],
        "max_abs_param_diff": param_diff, "max_abs_loss_diff": loss_diff,
    }
    for name, t in zip(sides, step_times, strict=True):
        results[name] = bench.step_stats(t.tolist(), tokens_per_step)
    results["ratio_minipar_over_ddp"], results["median_paired_ratio"] = bench.ratios(step_times[0], step_times[1])
    return results


def report(r: dict, args) -> None:
    psi = r["params"]
    print(f"model {r['model']} ({psi / 1e6:.2f}M params, float32) | {r['world']} ranks, {r['backend']}, "
          f"{r['device']}, {r['threads_per_rank']} thread(s)/rank | global batch "
          f"{r['global_batch']} x {r['seq_len']} tokens, micro-batch {r['micro_batch']} "
          f"({r['accum_steps']} per rank per step) | bucket {r['bucket_mb']:g} MB "
          f"(minipar: {r['minipar_buckets']} bucket(s)) | {args.steps} measured steps each after "
          f"{args.warmup} warm-up")
    print(bench.table_header(22))
    for name, label in (("minipar", "minipar DataParallel"), ("ddp", "torch DDP")):
        print(bench.table_row(label, r[name], 22))
    print(bench.ratio_line("ratio minipar / DDP", r["ratio_minipar_over_ddp"], r["median_paired_ratio"], 22))
    payload = 4 * psi  # float32 gradients
    print(f"minipar sent per step (ledger): {r['bytes_sent_per_step'] / 2**20:.2f} MiB per rank "
          f"(all-reduce of {payload / 2**20:.2f} MiB of gradients: 2(N-1)/N x that)")
    print(f"after {args.warmup + args.steps} steps: max |param minipar - param DDP| = {r['max_abs_param_diff']:.3g}, "
          f"max |loss difference| = {r['max_abs_loss_diff']:.3g}")
    bench.write_json(args.json, r)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = bench.world_size()
    cfg = TrainConfig(dp=world, model=args.model, seed=args.seed, steps=args.steps, seq_len=args.seq_len,
                      global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_mb=args.bucket_mb)
    if not bench.valid("bench_dp", lambda: cfg.validate(world), lambda: check_counts(args)):
        return 2
    device, mesh = bench.start(dp=world)
    model_cfg = get_config(cfg.model)
    sides = build_sides(cfg, model_cfg, mesh, device)
    run = run_steps(sides, args, cfg, model_cfg.vocab_size, mesh, device)
    results = summarise(run, sides, args, cfg, mesh, device)
    if dist.get_rank() == 0:
        report(results, args)
    bench.finish(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
