"""Benchmark: minipar's hand-written DataParallel against PyTorch's DistributedDataParallel.

    torchrun --nproc-per-node 2 scripts/bench_dp.py                   # about a minute on 2 CPU cores
    torchrun --nproc-per-node 2 scripts/bench_dp.py --micro-batch 2   # gradient accumulation, 4 per step
    torchrun --nproc-per-node 8 scripts/bench_dp.py --model 125m --json dp.json   # a GPU node (NCCL)

One launch trains two copies of the same model side by side, on every rank:

    (a) minipar   DataParallel(model, mesh.dp_group)      step: minipar.train.train_step
    (b) PyTorch   DistributedDataParallel(copy of model)  step: the same train_step

Both start from the same weights (Llama(config, seed)), see the same random token batches in the
same order, and step with the same AdamW (build_optimizer on one TrainConfig), the same gradient
clipping and the same accumulation: all micro-batches but the last inside `no_sync()`. They run
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
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from minipar.collectives import all_reduce
from minipar.config import ConfigError, TrainConfig
from minipar.data_parallel import DataParallel
from minipar.mesh import Mesh
from minipar.model import CONFIGS, Llama, get_config
from minipar.train import build_optimizer, start_distributed, train_step


class TorchDDP(DistributedDataParallel):
    """PyTorch's DDP, given the one method of minipar's DataParallel that train_step calls.

    DDP waits for its own all-reduces at the end of backward (a callback it queues in the autograd
    engine), so when train_step calls finish_grad_sync there is nothing left to do. With it, both
    sides run the very same train_step.
    """

    def finish_grad_sync(self) -> None:
        pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="named model size")
    p.add_argument("--steps", type=int, default=100, help="measured optimizer steps, each of the two")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured optimizer steps first, each of the two")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward on one rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size, both sides")
    p.add_argument("--seed", type=int, default=0, help="model weights and token batches")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p.parse_args(argv)


def rank_micro_batches(step: int, cfg: TrainConfig, vocab: int, rank: int, device) -> list[tuple]:
    """This rank's micro-batches of step `step`: its rows of a random global batch, the same on
    every rank and for both sides. Targets are the inputs shifted by one, as the data pipeline
    gives them."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (cfg.global_batch, cfg.seq_len + 1), generator=gen)
    rows = cfg.global_batch // cfg.dp
    mine = tokens[rank * rows : (rank + 1) * rows].to(device)  # [b/dp, s+1]
    x, y = mine[:, :-1], mine[:, 1:]
    return list(zip(x.split(cfg.micro_batch), y.split(cfg.micro_batch), strict=True))


def timed_step(model, optimizer, micro, cfg: TrainConfig, device) -> tuple[float, float]:
    """One optimizer step, from a barrier: (seconds on this rank, loss)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    t0 = time.perf_counter()
    loss, _ = train_step(model, optimizer, micro, cfg.grad_clip)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, loss


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = TrainConfig(dp=world, model=args.model, seed=args.seed, steps=args.steps, seq_len=args.seq_len,
                      global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_mb=args.bucket_mb)
    try:
        cfg.validate(world)
        if args.steps < 1 or args.warmup < 0:
            raise ConfigError("--steps must be at least 1 and --warmup at least 0")
    except ValueError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"bench_dp: error: {e}", file=sys.stderr)
        return 2

    # Ranks on one machine share its cores: one rank's threads beyond its share only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    device = start_distributed()
    rank = dist.get_rank()
    mesh = Mesh.build(dp=world)

    model_cfg = get_config(cfg.model)
    ours = DataParallel(Llama(model_cfg, seed=cfg.seed).to(device), mesh.dp_group, bucket_mb=cfg.bucket_mb)
    theirs = TorchDDP(Llama(model_cfg, seed=cfg.seed).to(device), process_group=mesh.dp_group.pg,
                      bucket_cap_mb=cfg.bucket_mb,
                      device_ids=[device.index] if device.type == "cuda" else None)
    sides = {
        "minipar": (ours, build_optimizer(ours.module, cfg)),
        "ddp": (theirs, build_optimizer(theirs.module, cfg)),
    }

    times = {name: [] for name in sides}
    losses = {name: [] for name in sides}
    sent, snapshot = [], {}
    for step in range(args.warmup + args.steps):
        micro = rank_micro_batches(step, cfg, model_cfg.vocab_size, mesh.dp_rank, device)
        order = ("minipar", "ddp") if step % 2 == 0 else ("ddp", "minipar")
        for name in order:
            model, optimizer = sides[name]
            mesh.ledger.reset()
            dt, loss = timed_step(model, optimizer, micro, cfg, device)
            losses[name].append(loss)
            if step >= args.warmup:
                times[name].append(dt)
                if name == "minipar":
                    sent.append(mesh.ledger.total_sent())
                    snapshot = mesh.ledger.snapshot()

    # A step takes as long as its slowest rank.
    step_times = torch.tensor([times["minipar"], times["ddp"]], dtype=torch.float64, device=device)
    all_reduce(step_times, mesh.dp_group, op="max")
    step_times = step_times.cpu()
    with torch.no_grad():
        param_diff = max((p - q).abs().max().item()
                         for p, q in zip(ours.module.parameters(), theirs.module.parameters(), strict=True))
    loss_diff = max(abs(a - b) for a, b in zip(losses["minipar"], losses["ddp"], strict=True))

    tokens_per_step = cfg.global_batch * cfg.seq_len
    psi = sum(p.numel() for p in ours.module.parameters())
    results = {
        "model": cfg.model, "params": psi, "world": world, "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(),
        "steps": args.steps, "warmup": args.warmup, "global_batch": cfg.global_batch,
        "micro_batch": cfg.micro_batch, "accum_steps": cfg.accum_steps, "seq_len": cfg.seq_len,
        "bucket_mb": cfg.bucket_mb, "minipar_buckets": len(ours.buckets),
        "bytes_sent_per_step": statistics.median(sent), "ledger": snapshot,
        "max_abs_param_diff": param_diff, "max_abs_loss_diff": loss_diff,
    }
    for i, name in enumerate(sides):
        t = step_times[i].tolist()
        results[name] = {"median_step_s": statistics.median(t), "min_step_s": min(t), "max_step_s": max(t),
                         "tokens_per_s": tokens_per_step / statistics.median(t), "step_times_s": t}
    results["ratio_minipar_over_ddp"] = results["minipar"]["median_step_s"] / results["ddp"]["median_step_s"]
    # The same ratio taken step by step (the two steps of a pair ran back to back, on the same
    # batch): less sensitive to slow drifts in the machine's load.
    results["median_paired_ratio"] = statistics.median((step_times[0] / step_times[1]).tolist())

    if rank == 0:
        print(f"model {cfg.model} ({psi / 1e6:.2f}M params, float32) | {world} ranks, {results['backend']}, "
              f"{results['device']}, {results['threads_per_rank']} thread(s)/rank | global batch "
              f"{cfg.global_batch} x {cfg.seq_len} tokens, micro-batch {cfg.micro_batch} "
              f"({cfg.accum_steps} per rank per step) | bucket {cfg.bucket_mb:g} MB "
              f"(minipar: {len(ours.buckets)} bucket(s)) | {args.steps} measured steps each after "
              f"{args.warmup} warm-up")
        print(f"{'':<22}{'median step':>13}{'min':>11}{'max':>11}{'tokens/s':>11}")
        for name, label in (("minipar", "minipar DataParallel"), ("ddp", "torch DDP")):
            r = results[name]
            print(f"{label:<22}{r['median_step_s'] * 1e3:>10.1f} ms{r['min_step_s'] * 1e3:>8.1f} ms"
                  f"{r['max_step_s'] * 1e3:>8.1f} ms{r['tokens_per_s']:>11,.0f}")
        print(f"ratio minipar / DDP   {results['ratio_minipar_over_ddp']:>10.3f}x   (goal: <= 1.0x); "
              f"median of step-by-step ratios {results['median_paired_ratio']:.3f}x")
        payload = 4 * psi  # float32 gradients
        print(f"minipar sent per step (ledger): {results['bytes_sent_per_step'] / 2**20:.2f} MiB per rank "
              f"(all-reduce of {payload / 2**20:.2f} MiB of gradients: 2(N-1)/N x that)")
        print(f"after {args.warmup + args.steps} steps: max |param minipar - param DDP| = {param_diff:.3g}, "
              f"max |loss difference| = {loss_diff:.3g}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
            print(f"wrote {args.json}")
    mesh.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
