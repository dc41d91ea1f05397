"""Benchmark: minipar's Muon against DDP with torch.optim.Muon (dp 2), and its owner method against
gather-everywhere (dp 4, ZeRO-1): each side's step time, and the Newton-Schulz time on each rank.

    torchrun --nproc-per-node 2 scripts/bench/bench_muon.py                       # against DDP + torch.optim.Muon
    torchrun --nproc-per-node 4 scripts/bench/bench_muon.py --compare methods     # owner against gather, ZeRO-1

One launch trains two copies of the same model (Llama(config, seed), float32) side by side, on every rank:

    --compare ddp (the default)
    (a) minipar   build_grad_sync(..., *optimizer_of(model, cfg)): DataParallel, and minipar's Muon on the
                  blocks' matrices with AdamW on the rest (muon.py)
    (b) PyTorch   DistributedDataParallel, torch.optim.Muon on the same matrices (the same lr, momentum,
                  Nesterov, Newton-Schulz steps, weight decay and lr adjustment) and minipar's AdamW on the rest
    --compare methods
    (a) owner     ZeRO-1, --muon-method owner: each matrix orthogonalised once, on its owner
    (b) gather    ZeRO-1, --muon-method gather: every rank gathers each cut bucket, orthogonalises every
                  matrix its slice overlaps

Both sides take the same train_step on the same random batches, in turn, step by step (bench_common's
rules, as bench_dp.py). Beside each step's time, each rank notes the CPU seconds it spent in
Newton-Schulz (minipar's `Muon.orthogonalised`, timed by a subclass; torch's `Muon.step` whole on side
(b) of ddp, which is little more). Rank 0 prints the median step time of each side and their ratio, the
Newton-Schulz seconds of each rank per step, and the largest difference between the two models'
weights at the end: equal arithmetic, so it must be float32 rounding at most (0 when the same bf16
matrices are orthogonalised, as torch's iteration is minipar's bit for bit).

--bucket-mb defaults to 0.25 under --compare methods: the small model's buckets then hold one or two
matrices each, cut four ways, as 8B's 25 MiB buckets hold about one matrix over 64 ranks (chapter 4c's
part (d)). CPU: gloo, torch threads shared among the ranks (1 each on 2 cores; 4 ranks on 2 cores are
oversubscribed, which is why Newton-Schulz is measured in CPU seconds, time.process_time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import bench_common as bench
import torch
import torch.distributed as dist

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.muon import Muon, muon_ids, muon_param_groups
from minipar.parallelize import BETAS, EPS, adamw, build_grad_sync
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.train import train_step


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.command_line(__doc__, "two", steps=30, warmup=3)
    p.add_argument("--compare", choices=["ddp", "methods"], default="ddp",
                   help="ddp: minipar's Muon against DDP + torch.optim.Muon; methods: owner against gather (ZeRO-1)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward on one rank")
    p.add_argument("--bucket-mb", type=float, default=None, help="bucket size (default: 25, or 0.25 for methods)")
    return bench.parse(p, argv)


class TimedMuon(Muon):
    """minipar's Muon, adding up the CPU seconds its Newton-Schulz (with any tp gather: none here) takes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ns_seconds = 0.0

    def orthogonalised(self, local, q, steps):
        t0 = time.process_time()
        out = super().orthogonalised(local, q, steps)
        self.ns_seconds += time.process_time() - t0
        return out


class TorchMuonAdamW:
    """torch.optim.Muon on the blocks' matrices and minipar's AdamW on the rest, stepped as one optimizer
    (TorchDDP calls step and zero_grad); ns_seconds: the CPU seconds of torch's Muon.step."""

    def __init__(self, model, cfg: TrainConfig):
        ids = muon_ids(model)
        self.muon = torch.optim.Muon([p for p in model.parameters() if id(p) in ids], lr=cfg.muon_lr,
                                     weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                                     nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                                     adjust_lr_fn=cfg.muon_adjust_lr)
        self.adamw = adamw([{**g, "params": [p for p in g["params"] if id(p) not in ids]}
                            for g in param_groups(model, cfg)], cfg.lr)
        self.ns_seconds = 0.0

    def step(self) -> None:
        t0 = time.process_time()
        self.muon.step()
        self.ns_seconds += time.process_time() - t0
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)


def minipar_side(cfg: TrainConfig, model_cfg, mesh: Mesh, device):
    model = Llama(model_cfg, seed=cfg.seed).to(device)
    make = partial(TimedMuon, lr=cfg.lr, groups=mesh.groups(), betas=BETAS, eps=EPS)
    return build_grad_sync(model, mesh.groups(), muon_param_groups(model, cfg, param_groups(model, cfg)), make,
                           zero=cfg.zero, bucket_mb=cfg.bucket_mb)


def build_sides(args, cfg: TrainConfig, model_cfg, mesh: Mesh, device) -> dict:
    """{side: wrapper}, both from the same weights."""
    if args.compare == "methods":
        return {m: minipar_side(TrainConfig(**{**vars(cfg), "muon_method": m}), model_cfg, mesh, device)
                for m in ("owner", "gather")}
    copy = Llama(model_cfg, seed=cfg.seed).to(device)
    theirs = bench.TorchDDP(copy, TorchMuonAdamW(copy, cfg), mesh.groups().dp, bucket_cap_mb=cfg.bucket_mb,
                            device_ids=[device.index] if device.type == "cuda" else None)
    return {"minipar": minipar_side(cfg, model_cfg, mesh, device), "ddp": theirs}


def run_steps(sides: dict, args, cfg: TrainConfig, vocab: int, mesh: Mesh, device) -> dict:
    """Both sides in turn: this rank's step times, losses, Newton-Schulz CPU seconds and bytes sent a measured step."""
    ns = {side: [] for side in sides}
    sent = {side: [] for side in sides}

    def note(side, measured: bool) -> None:
        optimizer = sides[side].optimizer
        if measured:
            ns[side].append(optimizer.ns_seconds)
            sent[side].append(mesh.ledger.total_sent())
        optimizer.ns_seconds = 0.0

    def batch(step: int) -> tuple:
        return (bench.rank_micro_batches(step, cfg, vocab, mesh.coord("dp"), device),)

    steps = {name: partial(train_step, model, grad_clip=cfg.grad_clip) for name, model in sides.items()}
    times, losses = bench.take_turns(steps, batch, args.warmup, args.steps, device, mesh.ledger, note)
    return {"times": times, "losses": losses, "ns": ns, "sent": sent}


def summarise(run: dict, sides: dict, args, cfg: TrainConfig, mesh: Mesh, device) -> dict:
    a, b = sides
    group = mesh.groups().dp
    step_times = bench.across_ranks([run["times"][a], run["times"][b]], group, device)
    ns_per_rank = {}
    for s in sides:  # every rank's median Newton-Schulz CPU seconds a step: rank r's in slot r
        mine = [0.0] * group.size
        mine[group.rank] = statistics.median(run["ns"][s])
        ns_per_rank[s] = bench.across_ranks(mine, group, device, "sum").tolist()
    with torch.no_grad():
        weights = [{n: p.detach() for n, p in sides[s].module.named_parameters()} for s in sides]
        param_diff = max((weights[0][n] - weights[1][n]).abs().max().item() for n in weights[0])
    results = {"compare": args.compare, "model": cfg.model, "world": group.size, **bench.machine(device),
               "steps": args.steps, "warmup": args.warmup, "global_batch": cfg.global_batch,
               "micro_batch": cfg.micro_batch, "seq_len": cfg.seq_len, "bucket_mb": cfg.bucket_mb, "zero": cfg.zero,
               "sides": list(sides), "ns_seconds_per_rank": ns_per_rank,
               "bytes_sent_per_step": {s: statistics.median(run["sent"][s]) for s in sides},
               "max_abs_param_diff": param_diff}
    tokens = cfg.global_batch * cfg.seq_len
    for name, t in zip(sides, step_times, strict=True):
        results[name] = bench.step_stats(t.tolist(), tokens)
    results["ratio"], results["median_paired_ratio"] = bench.ratios(step_times[0], step_times[1])
    return results


LABELS = {"minipar": "minipar Muon (DP)", "ddp": "DDP + torch Muon", "owner": "owner (ZeRO-1)",
          "gather": "gather (ZeRO-1)"}


def report(r: dict, args) -> None:
    a, b = r["sides"]
    print(f"model {r['model']}, float32 | {r['world']} ranks, {r['backend']}, {r['device']}, "
          f"{r['threads_per_rank']} thread(s)/rank | global batch {r['global_batch']} x {r['seq_len']} tokens, "
          f"micro-batch {r['micro_batch']} | bucket {r['bucket_mb']:g} MB, ZeRO {r['zero']} | {args.steps} measured "
          f"steps each after {args.warmup} warm-up")
    print(bench.table_header(22))
    for side in (a, b):
        print(bench.table_row(LABELS[side], r[side], 22))
    print(bench.ratio_line(f"ratio {a} / {b}", r["ratio"], r["median_paired_ratio"], 22))
    for side in (a, b):
        per_rank = ", ".join(f"{t * 1e3:.1f}" for t in r["ns_seconds_per_rank"][side])
        sent = r["bytes_sent_per_step"][side] / 2**20
        where = f"{sent:.2f} MiB sent a step per rank (ledger)" if side != "ddp" else "its bytes are not in the ledger"
        print(f"{LABELS[side]:<22} Newton-Schulz CPU ms a step, rank by rank: {per_rank} "
              f"(sum {sum(r['ns_seconds_per_rank'][side]) * 1e3:.1f}); {where}")
    print(f"after {args.warmup + args.steps} steps: max |weight {a} - weight {b}| = {r['max_abs_param_diff']:.3g}")
    bench.write_json(args.json, r)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = bench.world_size()
    methods = args.compare == "methods"
    bucket = args.bucket_mb if args.bucket_mb is not None else (0.25 if methods else 25.0)
    cfg = TrainConfig(dp=world, model=args.model, seed=args.seed, steps=args.steps, seq_len=args.seq_len,
                      global_batch=args.global_batch, micro_batch=args.micro_batch, bucket_mb=bucket,
                      optimizer="muon", zero=1 if methods else 0)

    def check_counts() -> None:
        if args.steps < 1 or args.warmup < 0:
            raise ConfigError("--steps must be at least 1 and --warmup at least 0")
        if methods and world < 2:
            raise ConfigError("--compare methods needs 2 or more ranks: ZeRO's slices cut the matrices")

    if not bench.valid("bench_muon", lambda: cfg.validate(world), check_counts):
        return 2
    device, mesh = bench.start(dp=world)
    model_cfg = get_config(cfg.model)
    sides = build_sides(args, cfg, model_cfg, mesh, device)
    run = run_steps(sides, args, cfg, model_cfg.vocab_size, mesh, device)
    results = summarise(run, sides, args, cfg, mesh, device)
    if dist.get_rank() == 0:
        report(results, args)
    bench.finish(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
