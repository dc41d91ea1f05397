"""Benchmark: minipar's ZeRO-1 and ZeRO-3 against PyTorch's ZeroRedundancyOptimizer and FSDP2.

    torchrun --standalone --nproc-per-node 2 scripts/bench/bench_zero.py        # about a minute on 2 CPU cores
    torchrun --standalone --nproc-per-node 2 scripts/bench/bench_zero.py --only zero3   # one of the two pairs
    torchrun --nproc-per-node 8 scripts/bench/bench_zero.py --model 125m --json zero.json   # a GPU node (NCCL)

One launch trains four copies of the same model side by side, on every rank:

    (1) minipar  build_grad_sync(model, groups, zero=1)            step: minipar.run.train.train_step
        PyTorch  DistributedDataParallel + ZeroRedundancyOptimizer  step: torch_step (below)
    (2) minipar  build_grad_sync(model, groups, zero=3)            step: minipar.run.train.train_step
        PyTorch  fully_shard on each transformer layer, then root  step: torch_step

DDP + ZeroRedundancyOptimizer is the combination PyTorch documents for ZeRO-1: DDP all-reduces
the gradients during backward, each rank updates the parameters it owns, and broadcasts them.
fully_shard per layer and then on the root is FSDP2's documented use, and the same units as
minipar's ZeRO-3 (units_of: the embedding, each layer, the final norm, the LM head).

All four start from Llama(config, seed), see the same random token batches (bench_dp's), and step
with the same AdamW (parallelize.adamw on param_groups of one TrainConfig: lr 3e-3, betas (0.9, 0.95),
weight decay 0.1 on matrices) and the same gradient clipping (1.0). Each pair runs in turn, step
by step (a b, b a, ...), after `--warmup` unmeasured steps; each step starts from a barrier and
takes as long as its slowest rank. Rank 0 prints the median step times, their ratio (goal: <= 1.0x),
and the median of the step-by-step ratios, which is less sensitive to drifts in the machine's load.

Memory, per rank, three figures for each side:

    held        bytes of the tensors the side keeps *between* steps, counted on the tensors
                themselves (each storage once, at its allocated size, so padding counts and a
                freed ZeRO-3 / FSDP2 buffer counts 0): the weights present (minipar also keeps
                fp32 master slices; FSDP2 its DTensor local shards), the gradients still alive,
                the optimizer state, and DDP's gradient buckets (flat buffers inside its C++
                reducer, invisible to Python: their sizes come from DDP's logging data).
    step rise   how far memory climbs above its level at the start of a step, during the step
                (the median over `--memory-steps` steps, run after the timed ones): activations,
                full gradients, gathered layers, communication buffers. On CUDA:
                torch.cuda.max_memory_allocated minus memory_allocated at the start. On CPU: the
                process's resident-set high-water mark (VmHWM, reset before each step by writing 5
                to /proc/self/clear_refs) minus the resident set at the start. For the resident
                set to follow the tensors, glibc first hands its free memory back (malloc_trim:
                otherwise the step reuses pages already counted) and serves every allocation over
                64 KiB with its own mapping, unmapped when freed (mallopt M_MMAP_THRESHOLD). Both
                slow allocation down, hence the separate steps. Expect a few MiB of jitter.
    peak        held + step rise: the most this side needs at once.

Because the four models live in one process, an absolute peak (max_memory_allocated, ru_maxrss)
would be everyone's; the per-side figures above are what can be attributed. On CUDA the absolute
max_memory_allocated of each side's steps is printed too, for reference.

Equivalence: at the end both sides of a pair must hold the same parameters up to float32 rounding
(the gradient norm is summed in a different order; while it stays below --grad-clip the clip
coefficient is exactly 1 and the sides agree bit for bit: --grad-clip 0.3 exercises clipping).
A larger difference would mean the two sides did not do the same work, and the timings would
compare nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from contextlib import nullcontext
from functools import partial

import bench_common as bench
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import BETAS, EPS, adamw, build_grad_sync
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.train import train_step
from minipar.zero import ZeroDataParallel
from minipar.zero3 import Zero3DataParallel

PAIRS = {"zero1": ("minipar ZeRO-1", "torch DDP+ZeRO-1"), "zero3": ("minipar ZeRO-3", "torch FSDP2")}


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.command_line(__doc__, "four", steps=30, warmup=5)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward on one rank")
    p.add_argument("--memory-steps", type=int, default=4, help="steps each measuring memory, after the timed ones")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clipping, all sides")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="ZeRO-1 bucket size, both sides")
    p.add_argument("--only", choices=list(PAIRS), default=None, help="run one of the two comparisons")
    return bench.parse(p, argv)


# ----------------------------------------------------------------------------------------------
# Memory: what a side holds, and how far a step climbs above it
# ----------------------------------------------------------------------------------------------


def storage_bytes(tensors) -> int:
    """Allocated bytes behind these tensors, each storage once (DTensors: their local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def held_bytes(model, optimizer) -> dict[str, int]:
    """{params, grads, optimizer, buckets}: this rank's bytes between steps, counted on the tensors."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    if isinstance(model, ZeroDataParallel):  # its fp32 master slices, their gradients, its own optimizer
        params += [b.master for b in model.buckets]
        grads += [b.grad_slice for b in model.buckets]
        optimizer = model.optimizer
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)]
    buckets = 0
    if isinstance(model, DistributedDataParallel):  # the reducer's flat gradient buffers
        sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
        buckets = sum(int(b) for b in str(sizes).split(",") if b.strip())
    return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(state),
            "buckets": buckets}


class StepMemory:
    """How far this process's memory climbs above its level at the start of a step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.libc = ctypes.CDLL("libc.so.6") if device.type == "cpu" else None

    def follow_tensors(self) -> None:
        """CPU: from now on glibc gives every allocation over 64 KiB its own mapping, returned to
        the system when freed, so that the resident set falls with the tensors. (Allocation gets
        slower, so the timed steps run before this.)"""
        if self.libc is not None:
            self.libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (fixing it also stops glibc moving it)
            self.libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024  # kB
        return 0

    def now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._status("VmRSS:")

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            # Free heap memory left from earlier steps would be reused without touching new pages:
            # hand it back first, so that every byte the step uses shows in the resident set.
            self.libc.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        self.base = self.now()

    def stop(self) -> tuple[int, int]:
        """(rise above the start, absolute peak)."""
        peak = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                else self._status("VmHWM:"))
        return peak - self.base, peak


# ----------------------------------------------------------------------------------------------
# The two PyTorch sides, and their step
# ----------------------------------------------------------------------------------------------


def torch_zero1(model, cfg: TrainConfig, mesh: Mesh, device):
    """DDP + ZeroRedundancyOptimizer holding AdamW with minipar's settings (parallelize.adamw)."""
    ddp = DistributedDataParallel(model, process_group=mesh.groups().dp.pg, bucket_cap_mb=cfg.bucket_mb,
                                  device_ids=[device.index] if device.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(param_groups(model, cfg), optimizer_class=torch.optim.AdamW,
                                  process_group=mesh.groups().dp.pg, lr=cfg.lr, betas=BETAS, eps=EPS)
    reference = adamw(param_groups(model, cfg), cfg.lr)  # the settings must be parallelize.adamw's
    for mine, ref in zip(opt.optim.param_groups, reference.param_groups, strict=True):
        assert {k: v for k, v in mine.items() if k != "params"} == {k: v for k, v in ref.items() if k != "params"}
    return ddp, opt


def torch_fsdp2(model, cfg: TrainConfig, mesh: Mesh, device):
    """fully_shard on every transformer layer, then on the root (embedding, final norm, head)."""
    device_mesh = DeviceMesh.from_group(mesh.groups().dp.pg, device.type)
    for layer in model.layers.values():
        fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    return model, adamw(param_groups(model, cfg), cfg.lr)


def torch_step(model, optimizer, micro_batches, grad_clip: float):
    """PyTorch's own loop: gradients synchronised on the last micro-batch only, clip_grad_norm_, step."""
    n = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == n - 1
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(last)
            sync = nullcontext()
        else:
            sync = nullcontext() if last else model.no_sync()
        with sync:
            loss = model(x, y) / n
            loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def full_params(side) -> dict[str, torch.Tensor]:
    """Every full parameter by name, copied (ZeRO-3 gathers, FSDP2 all-gathers its DTensors)."""
    model = side["model"]
    if isinstance(model, Zero3DataParallel):
        with model.gathered():
            return {n: p.detach().clone() for n, p in model.module.named_parameters()}
    module = model.module if hasattr(model, "module") else model
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters()}


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def check_counts(args) -> None:
    if args.steps < 1 or args.memory_steps < 1 or args.warmup < 0:
        raise ConfigError("--steps and --memory-steps must be at least 1, --warmup at least 0")


def step_function(model, optimizer, cfg: TrainConfig):
    """micro-batches -> loss: minipar's train_step (optimizer None: the wrapper owns its own), or torch_step."""
    if optimizer is None:
        return lambda micro: train_step(model, micro, cfg.grad_clip)[0]
    return lambda micro: torch_step(model, optimizer, micro, cfg.grad_clip)


def build_sides(pairs: dict, cfg: TrainConfig, new_model, mesh: Mesh, device) -> dict:
    """Every side of the pairs asked for, each on a fresh Llama(config, seed): {name: its model, its
    optimizer (None: minipar's wrappers own theirs), its step function and its figures so far}."""
    def minipar(model, stage):
        return build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr), zero=stage,
                               bucket_mb=cfg.bucket_mb), None

    builders = {
        "minipar ZeRO-1": lambda m: minipar(m, 1),
        "torch DDP+ZeRO-1": lambda m: torch_zero1(m, cfg, mesh, device),
        "minipar ZeRO-3": lambda m: minipar(m, 3),
        "torch FSDP2": lambda m: torch_fsdp2(m, cfg, mesh, device),
    }
    sides = {}
    for pair in pairs.values():
        for name in pair:
            model, optimizer = builders[name](new_model())
            sides[name] = {"model": model, "optimizer": optimizer, "step": step_function(model, optimizer, cfg),
                           "times": [], "losses": [], "rise": [], "peak": [], "sent": []}
    return sides


def run_step(side: dict, micro, measure: str | None, mesh: Mesh, memory: StepMemory, device) -> None:
    """One optimizer step of one side, from a barrier; notes its loss, and its time and bytes sent
    (measure "time") or how far memory rose (measure "memory")."""
    mesh.ledger.reset()
    dt, loss = bench.timed(side["step"], micro, device=device,
                           at_start=memory.start if measure == "memory" else None)
    side["losses"].append(loss)
    if measure == "time":
        side["times"].append(dt)
        side["sent"].append(mesh.ledger.total_sent())
    if measure == "memory":
        rise, peak = memory.stop()
        side["rise"].append(rise)
        side["peak"].append(peak)


def run_steps(sides: dict, pairs: dict, args, cfg: TrainConfig, vocab: int, mesh: Mesh, device) -> int:
    """Warm-up steps, timed steps, then a few steps measuring memory (which slows allocation on CPU);
    the two sides of each pair in turn. Returns the number of steps."""
    memory = StepMemory(device)
    phases = [None] * args.warmup + ["time"] * args.steps + ["memory"] * args.memory_steps
    for step, measure in enumerate(phases):
        if measure == "memory" and phases[step - 1] != "memory":
            memory.follow_tensors()
        micro = bench.rank_micro_batches(step, cfg, vocab, mesh.coord("dp"), device)  # bench_dp's batches
        for pair in pairs.values():
            for name in bench.turns(pair, step):
                run_step(sides[name], micro, measure, mesh, memory, device)
    return len(phases)


def compare(a: str, b: str, sides: dict, initial: dict, mesh: Mesh, device) -> dict:
    """The results of one pair: time and memory per side, their ratios, and how far apart they ended."""
    # A step takes as long as its slowest rank; memory: the largest rank's.
    times = bench.across_ranks([sides[a]["times"], sides[b]["times"]], mesh.groups().dp, device)
    rises = bench.across_ranks([sides[a]["rise"], sides[b]["rise"]], mesh.groups().dp, device)
    pa, pb = full_params(sides[a]), full_params(sides[b])
    param_diff = max((pa[n] - pb[n]).abs().max().item() for n in pa)
    moved = max((pa[n] - p0).abs().max().item() for n, p0 in initial.items())  # the check is not vacuous
    loss_diff = max(abs(x - y) for x, y in zip(sides[a]["losses"], sides[b]["losses"], strict=True))
    out = {"max_abs_param_diff": param_diff, "max_abs_loss_diff": loss_diff, "max_abs_param_change": moved}
    for i, name in enumerate((a, b)):
        held = held_bytes(sides[name]["model"], sides[name]["optimizer"])
        held_total = int(bench.across_ranks([sum(held.values())], mesh.groups().dp, device).item())
        rise = statistics.median(rises[i].tolist())
        out[name] = bench.step_stats(times[i].tolist()) | {
            "held": held, "held_total_max_rank": held_total,
            "step_rise_median": rise, "step_rise_max": max(rises[i].tolist()), "peak": int(held_total + rise),
            "abs_peak_max": max(sides[name]["peak"]),
            "sent_per_step": statistics.median(sides[name]["sent"]) if name.startswith("minipar") else None}
    out["ratio_time"], out["median_paired_ratio"] = bench.ratios(times[0], times[1])
    out["ratio_held"] = out[a]["held_total_max_rank"] / out[b]["held_total_max_rank"]
    out["ratio_peak"] = out[a]["peak"] / out[b]["peak"]
    return out


def report_pair(a: str, b: str, out: dict, n_steps: int, device) -> None:
    mib = 2**20
    unit = "allocated" if device.type == "cuda" else "resident set"
    print("\n" + bench.table_header(18, f"   held MiB (params + grads + optim + DDP buckets)   step rise ({unit})"
                                        "   peak"))
    for name in (a, b):
        r, h = out[name], out[name]["held"]
        print(bench.table_row(name, r, 18) + f"   {sum(h.values()) / mib:6.2f} = {h['params'] / mib:.2f}"
              f" + {h['grads'] / mib:.2f} + {h['optimizer'] / mib:.2f} + {h['buckets'] / mib:.2f}"
              f"{'':>6}{r['step_rise_median'] / mib:8.2f} MiB{'':>10}{r['peak'] / mib:6.2f} MiB")
    print(f"ratio minipar / torch: time {out['ratio_time']:.3f}x (median of step-by-step ratios "
          f"{out['median_paired_ratio']:.3f}x), held {out['ratio_held']:.3f}x, peak {out['ratio_peak']:.3f}x"
          f"   (goals: <= 1.0x)")
    if device.type == "cuda":
        print(f"torch.cuda.max_memory_allocated during the steps (all four models live): "
              f"{a} {out[a]['abs_peak_max'] / mib:.1f} MiB, {b} {out[b]['abs_peak_max'] / mib:.1f} MiB")
    print(f"{a} sent per step (ledger): {out[a]['sent_per_step'] / mib:.2f} MiB per rank")
    print(f"after {n_steps} steps: max |param {a} - param {b}| = "
          f"{out['max_abs_param_diff']:.3g}, max |loss difference| = {out['max_abs_loss_diff']:.3g} "
          f"(the weights moved by up to {out['max_abs_param_change']:.3g})")


def report(results: dict, pairs: dict, args, cfg: TrainConfig, n_steps: int, device) -> None:
    psi = results["params"]
    print(f"model {cfg.model} ({psi / 1e6:.2f}M params = {4 * psi / 2**20:.2f} MiB float32) | "
          f"{results['world']} ranks, {results['backend']}, {results['device']}, {results['threads_per_rank']} "
          f"thread(s)/rank | global batch {cfg.global_batch} x {cfg.seq_len} tokens, micro-batch "
          f"{cfg.micro_batch} ({cfg.accum_steps} per rank per step) | {args.steps} timed steps each after "
          f"{args.warmup} warm-up, then {args.memory_steps} measuring memory | grad clip {cfg.grad_clip:g}")
    for pair, (a, b) in pairs.items():
        report_pair(a, b, results["pairs"][pair], n_steps, device)
    bench.write_json(args.json, results)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = bench.world_size()
    cfg = TrainConfig(dp=world, model=args.model, seed=args.seed, seq_len=args.seq_len,
                      global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_mb=args.bucket_mb,
                      grad_clip=args.grad_clip)
    if not bench.valid("bench_zero", lambda: cfg.validate(world), lambda: check_counts(args)):
        return 2
    device, mesh = bench.start(dp=world)
    model_cfg = get_config(cfg.model)

    def new_model():
        return Llama(model_cfg, seed=cfg.seed).to(device)

    pairs = {k: v for k, v in PAIRS.items() if args.only in (None, k)}
    sides = build_sides(pairs, cfg, new_model, mesh, device)
    n_steps = run_steps(sides, pairs, args, cfg, model_cfg.vocab_size, mesh, device)

    initial = {n: p.detach() for n, p in new_model().named_parameters()}
    results = {"model": cfg.model, "params": sum(p.numel() for p in initial.values()), "world": world,
               **bench.machine(device), "steps": args.steps,
               "warmup": args.warmup, "global_batch": cfg.global_batch, "micro_batch": cfg.micro_batch,
               "accum_steps": cfg.accum_steps, "seq_len": cfg.seq_len, "bucket_mb": cfg.bucket_mb,
               "pairs": {pair: compare(a, b, sides, initial, mesh, device) for pair, (a, b) in pairs.items()}}
    if dist.get_rank() == 0:
        report(results, pairs, args, cfg, n_steps, device)
    bench.finish(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
