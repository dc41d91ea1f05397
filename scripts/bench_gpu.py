"""Benchmark on the GPUs present: minipar against PyTorch's own, strategy by strategy, in one run.

    make bench-gpu                                    # every GPU here; appends to docs/benchmarks.md
    python scripts/bench_gpu.py --models 125m --strategies dp zero3 --steps 5
    torchrun --nproc-per-node 8 scripts/bench_gpu.py --compile --fused-adamw

For each model (default 125m and 1b, seq 2048, bfloat16 autocast over float32 master weights, as
train.py runs on CUDA) and each strategy the GPU count allows, two sides train the same model on
the same random token batches with the same AdamW, clipping and gradient accumulation:

    strategy  minipar                                 PyTorch
    dp        DataParallel                            DistributedDataParallel
    zero1     ZeroDataParallel(stage 1)               DDP + ZeroRedundancyOptimizer
    zero2     ZeroDataParallel(stage 2)               FSDP2 fully_shard(reshard_after_forward=False)
    zero3     Zero3DataParallel                       FSDP2 fully_shard (per layer, then the root)

The sides run one after the other, each in fresh processes (one per GPU, under torchrun): a 1b
model and its optimizer, twice, do not fit one GPU together, and nothing one side leaves behind
(compiled code, allocator caches) may weigh on the next. Each gets `--warmup` unmeasured steps
(compilation happens there), then `--steps` timed ones from a barrier to torch.cuda.synchronize.
Reported per side: median step time,
tokens/s, MFU = training FLOPs per token x tokens/s / (GPUs x the GPU's dense bf16 peak), and the
peak of torch.cuda.max_memory_allocated above what was allocated before the side was built;
then the ratio of throughputs minipar / PyTorch (the goal is >= 1.0x) and the difference of the
two sides' losses at the first step (same weights, same tokens: it must be at bf16 rounding, or
the timings compare different work) and at worst over all steps (bf16 rounding, summed
differently by each side, compounds step by step).

Tensor, pipeline and context parallelism need two GPUs or more and are not measured by this
script yet (scripts/bench_tp.py, bench_pp.py and bench_cp.py measure them, in float32): with one
GPU the table says so rather than run them.

Without CUDA it prints "no GPU" and exits 0, so `make bench-gpu` is safe anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

STRATEGIES = ("dp", "zero1", "zero2", "zero3")
NEEDS_TWO = ("tp", "pp", "cp")
MICRO_BATCH = {"125m": 8, "1b": 4}  # sequences of 2048 tokens per forward, chosen to fit 80 GB


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=["125m", "1b"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES + NEEDS_TWO)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per rank per step")
    p.add_argument("--micro-batch", type=int, default=None, help="default: 8 for 125m, 4 for 1b")
    p.add_argument("--steps", type=int, default=8, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per side (compilation included)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate, both sides (no warm-up)")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer layer, both sides")
    p.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True), both sides")
    p.add_argument("--append", default=None, metavar="MD", help="append the table to this markdown file")
    p.add_argument("--one", nargs=3, metavar=("MODEL", "STRATEGY", "SIDE"), help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# The two sides of each strategy
# ----------------------------------------------------------------------------------------------


class TorchDDP(torch.nn.parallel.DistributedDataParallel):
    def finish_grad_sync(self) -> None:  # DDP has already waited for its all-reduces in backward
        pass


def build_side(strategy: str, side: str, model, groups_of, adamw, mesh, device):
    """(model, optimizer, step) for one side; step(micro_batches) -> loss."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from minipar.data_parallel import DataParallel
    from minipar.train import train_step
    from minipar.zero import ZeroDataParallel
    from minipar.zero3 import Zero3DataParallel

    group = mesh.dp_group
    if side == "minipar":  # every wrapper holds its optimizer (minipar/data_parallel.py's protocol)
        if strategy == "dp":
            wrapped = DataParallel(model, group, optimizer=adamw(groups_of(model)))
        elif strategy in ("zero1", "zero2"):
            wrapped = ZeroDataParallel(model, group, int(strategy[-1]), adamw, groups_of(model))
        else:
            wrapped = Zero3DataParallel(model, group, adamw, groups_of(model))
        return wrapped, wrapped.optimizer, lambda micro: train_step(wrapped, micro, 1.0, autocast)[0]
    if strategy in ("dp", "zero1"):
        wrapped = TorchDDP(model, process_group=group.pg, device_ids=[device.index])
        if strategy == "dp":
            opt = adamw(groups_of(model))
        else:
            opt = ZeroRedundancyOptimizer(groups_of(model), optimizer_class=torch.optim.AdamW,
                                          process_group=group.pg, **adamw.defaults)
    else:
        from torch.distributed.device_mesh import DeviceMesh

        device_mesh = DeviceMesh.from_group(group.pg, "cuda")
        for layer in model.layers.values():
            fully_shard(layer, mesh=device_mesh, reshard_after_forward=strategy == "zero3")
        wrapped = fully_shard(model, mesh=device_mesh, reshard_after_forward=strategy == "zero3")
        opt = adamw(groups_of(model))
    return wrapped, opt, lambda micro: torch_step(wrapped, opt, micro)


def autocast():
    return torch.autocast("cuda", dtype=torch.bfloat16)


def torch_step(model, optimizer, micro_batches) -> float:
    """PyTorch's own loop: gradients synchronised on the last micro-batch, clip_grad_norm_, step."""
    from torch.distributed.fsdp import FSDPModule

    n, total = len(micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == n - 1
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(last)
        with nullcontext() if last or isinstance(model, FSDPModule) else model.no_sync(), autocast():
            loss = model(x, y) / n
        loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


# ----------------------------------------------------------------------------------------------
# Measuring one side
# ----------------------------------------------------------------------------------------------


def batches(step: int, world: int, rank: int, micro: int, accum: int, seq: int, vocab: int, device):
    """This rank's micro-batches of step `step`: the same random tokens for both sides."""
    gen = torch.Generator().manual_seed(1_000_003 + step)
    tokens = torch.randint(0, vocab, (world * micro * accum, seq + 1), generator=gen)
    mine = tokens[rank * micro * accum:(rank + 1) * micro * accum].to(device)
    return list(zip(mine[:, :-1].split(micro), mine[:, 1:].split(micro)))


def measure(strategy, side, name, args, mesh, device, micro) -> dict:
    from minipar.model import Llama, get_config
    from minipar.train import TrainConfig, param_groups

    model_cfg = get_config(name)
    cfg = TrainConfig(model=name, lr=args.lr)

    def adamw(groups):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=args.fused_adamw or None)
    adamw.defaults = {"lr": cfg.lr, "betas": (0.9, 0.95), "eps": 1e-8, "fused": args.fused_adamw or None}

    torch._dynamo.reset()  # compiled code holds the last side's modules: let them go
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)  # should be ~0: anything left would inflate the peak
    model = Llama(model_cfg, seed=0).to(device)
    if args.compile:  # the layer's forward only: wrappers' hooks (ZeRO-3, FSDP2) stay eager around it
        for layer in model.layers.values():
            layer.forward = torch.compile(layer.forward)
    wrapped, opt, step = build_side(strategy, side, model, lambda m: param_groups(m, cfg), adamw, mesh, device)
    world, rank = dist.get_world_size(), dist.get_rank()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        micro_batches = batches(i, world, rank, micro, args.accum, args.seq_len, model_cfg.vocab_size, device)
        torch.cuda.synchronize()
        dist.barrier(device_ids=[device.index])
        t0 = time.perf_counter()
        losses.append(step(micro_batches))
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    t = statistics.median(slowest.tolist())
    tokens = world * micro * args.accum * args.seq_len
    peak = peak_flops(device)
    result = {"step_s": t, "tokens_per_s": tokens / t, "losses": losses,
              "mfu": model_cfg.flops_per_token(args.seq_len) * tokens / t / (world * peak) if peak else None,
              "peak_gib": (torch.cuda.max_memory_allocated(device) - base) / 2**30, "left_gib": base / 2**30}
    del wrapped, opt, step, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def peak_flops(device) -> float | None:
    from minipar.run_log import peak_flops as known

    return known(device)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def run_one(args) -> dict:
    """This process's part of one side (--one MODEL STRATEGY SIDE), under torchrun."""
    from minipar.mesh import Mesh
    from minipar.train import start_distributed

    name, strategy, side = args.one
    device = start_distributed()
    mesh = Mesh.build(dp=dist.get_world_size())
    try:
        result = measure(strategy, side, name, args, mesh, device, args.micro_batch or MICRO_BATCH.get(name, 4))
    except torch.cuda.OutOfMemoryError:
        result = {"error": "out of memory"}
    except Exception as e:  # noqa: BLE001 - a bug found is a result: report it, go on
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    mesh.destroy()
    dist.destroy_process_group()
    return result


def run(args, argv: list[str]) -> list[dict]:
    """Every side in a fresh set of processes, one per GPU: nothing one side leaves in GPU memory
    (compiled code, caches, fragmentation) can weigh on the next."""
    n = torch.cuda.device_count()
    rows = []
    for name in args.models:
        for strategy in args.strategies:
            row = {"model": name, "strategy": strategy, "world": n}
            if strategy in NEEDS_TWO:
                row["note"] = "not measured by bench_gpu (needs >= 2 GPUs and is not built here yet)"
                rows.append(row)
                continue
            for side in ("minipar", "torch"):
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "side.json"
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           __file__, *argv, "--one", name, strategy, side, "--json", str(out)]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    row[side] = (json.loads(out.read_text()) if out.exists() else
                                 {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-200:]}"})
                print(f"{name} {strategy} {side}: {summary(row[side])}", flush=True)
            rows.append(row)
    return rows


def summary(side: dict) -> str:
    if "error" in side:
        return side["error"]
    mfu = f"{side['mfu']:.1%}" if side["mfu"] is not None else "n/a"
    return (f"{side['step_s'] * 1e3:.0f} ms/step, {side['tokens_per_s']:,.0f} tok/s, MFU {mfu}, "
            f"losses {side['losses'][0]:.5f} -> {side['losses'][-1]:.5f}, "
            f"peak {side['peak_gib']:.1f} GiB above {side['left_gib']:.2f} GiB left before it")


def table(rows: list[dict], args, device_name: str) -> str:
    peer = {"dp": "DDP", "zero1": "DDP+ZeRO-1 optim", "zero2": "FSDP2 (no reshard)", "zero3": "FSDP2"}
    out = [f"\n### GPU run: {device_name} x {rows[0]['world'] if rows else 0}, "
           f"{datetime.date.today()}, torch {torch.__version__}\n",
           f"`python scripts/bench_gpu.py {' '.join(sys.argv[1:])}` — bf16 autocast over fp32 weights, seq "
           f"{args.seq_len}, {args.accum} micro-batches per step, compile {'on' if args.compile else 'off'}, "
           f"fused AdamW {'on' if args.fused_adamw else 'off'}\n",
           "| model | strategy | peer | minipar tok/s | minipar MFU | minipar peak GiB | peer tok/s | peer MFU "
           "| peer peak GiB | ratio | loss diff: step 1 / max |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "note" in r:
            out.append(f"| {r['model']} | {r['strategy']} | | {r['note']} | | | | | | | |")
            continue
        a, b = r["minipar"], r["torch"]
        cells = []
        for s in (a, b):
            if "error" in s:
                cells += [s["error"], "", ""]
            else:
                cells += [f"{s['tokens_per_s']:,.0f}", f"{s['mfu']:.1%}" if s["mfu"] else "n/a", f"{s['peak_gib']:.1f}"]
        ok = "error" not in a and "error" not in b
        ratio = f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}x" if ok else "-"
        diff = (f"{abs(a['losses'][0] - b['losses'][0]):.2g} / "
                f"{max(abs(x - y) for x, y in zip(a['losses'], b['losses'])):.2g}") if ok else "-"
        out.append(f"| {r['model']} | {r['strategy']} | {peer[r['strategy']]} | {cells[0]} | {cells[1]} | "
                   f"{cells[2]} | {cells[3]} | {cells[4]} | {cells[5]} | {ratio} | {diff} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench-gpu: no GPU (torch.cuda.is_available() is False): nothing to measure")
        return 0
    if args.one:  # one side, in the processes the orchestrator below started
        result = run_one(args)
        if dist.is_available() and int(os.environ.get("RANK", "0")) == 0:
            Path(args.json).write_text(json.dumps(result))
        return 0
    rows = run(args, [a for a in argv if a != "--append" and a != args.append])
    text = table(rows, args, torch.cuda.get_device_name())
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text)
        print(f"appended to {args.append}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
