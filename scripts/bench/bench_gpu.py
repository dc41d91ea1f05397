"""Benchmark on the GPUs present: minipar against PyTorch's own, strategy by strategy, in one run.

    make bench-gpu                                    # every GPU here; appends to docs/benchmarks.md
    python scripts/bench/bench_gpu.py --models 125m --strategies dp zero3 tp --steps 5
    python scripts/bench/bench_gpu.py --compile --fused-adamw --strategies pp --pp-schedule gpipe

For each model (default 125m and 1b, seq 2048, bfloat16 autocast over float32 weights (no master copy), as
train.py runs on CUDA) and each strategy the GPU count allows, two sides train the same model on
the same random token batches with the same AdamW, clipping and gradient accumulation, every GPU
one rank of the strategy's dimension (dp = world, or tp = world, ...):

    strategy  minipar                                 PyTorch
    dp        DataParallel                            DistributedDataParallel
    zero1     ZeroDataParallel(stage 1)               DDP + ZeroRedundancyOptimizer
    zero2     ZeroDataParallel(stage 2)               FSDP2 fully_shard(reshard_after_forward=False)
    zero3     Zero3DataParallel                       FSDP2 fully_shard (per layer, then the root)
    tp        parallelize(tp=...)                     DTensor: parallelize_module with torchtitan's
                                                      plan, loss_parallel (bench_common, as bench_tp.py)
    tp_overlap  parallelize(tp=..., tp_overlap=True)  the same: minipar's tp with each region's input
                                                      gradient sent while its weight gradients are
                                                      computed (chapter 4), beside tp's blocking row
    pp        Pipeline(--pp-schedule)                 torch.distributed.pipelining: PipelineStage and
                                                      Schedule1F1B / ScheduleGPipe (as bench_pp.py)
    cp        ring attention (parallelize(cp=...))    torch.distributed.tensor.experimental.
                                                      context_parallel: SDPA patched to its ring, DDP
                                                      over the cp ranks, head-tail (zigzag) sharding

tp, pp and cp need 2 GPUs or more (with one, the table says so); a layout the model cannot take
(tp not dividing the heads, more stages than layers) is a row with the reason. Batches: under dp
and ZeRO every rank has its rows of a global batch of world x micro-batch x --accum sequences;
under tp, pp and cp (dp = 1) all ranks share one batch of micro-batch x --accum sequences (pp: at
least one micro-batch per stage), cut into the sequence shares under cp. The pipeline's loss is
each micro-batch's mean cross-entropy / m on both sides (all tokens are real: minipar's token mean
is the same number); context parallelism's torch side takes the mean of its rank's tokens and DDP
averages the equal shares, minipar's divides by the global count (train_step). One difference in
the work of cp: the model repeats k and v to the query heads before SDPA (model.causal_attention),
so torch's ring passes K/V at the query heads' width while minipar's passes the kv heads' (the 1b
model: 4x the bytes; 125m has as many kv heads as heads: the same).

The sides run one after the other, each in fresh processes (one per GPU, under torchrun): a 1b
model and its optimizer, twice, do not fit one GPU together, and nothing one side leaves behind
(compiled code, allocator caches) may weigh on the next. Each gets `--warmup` unmeasured steps
(compilation happens there), then `--steps` timed ones from a barrier to torch.cuda.synchronize.
Reported per side: median step time, tokens/s, MFU = training FLOPs per token x tokens/s / (GPUs x
the GPU's dense bf16 peak; FLOPs by ModelConfig.flops_per_token, 6 x (N - input embedding) +
12 x L x d x s, a convention the run prints first and the table repeats), and the peak of
torch.cuda.max_memory_allocated above what was allocated before the side was built; then the ratio
of throughputs minipar / PyTorch (the goal is >= 1.0x) and the difference of the two sides' losses
(each step's loss averaged over the ranks, summed over the stages under pp) at the first step (same
weights, same tokens: it must be at bf16 rounding, or the timings compare different work) and at
worst over all steps (bf16 rounding, summed differently by each side, compounds step by step).

`--compile` (torch.compile of each transformer layer's forward) and `--fused-adamw` apply to both
sides; attention is F.scaled_dot_product_attention (flash or memory-efficient kernels on CUDA) on
both, except minipar's cp, whose ring attention is its own code.

Without CUDA it prints "no GPU" and exits 0, so `make bench-gpu` is safe anywhere. A hidden
`--device cpu` runs the same code on gloo in float32 (`--ranks` processes, no autocast, no memory
figures) so that tests/test_bench_gpu.py can prove on a CPU that both sides of each strategy
compute the same losses; torch's context_parallel has no CPU kernels, so there cp's torch side is
a row that says so.
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
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import bench_common as bench
import torch
import torch.distributed as dist

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tp", "tp_overlap", "pp", "cp")
NEEDS_TWO = ("tp", "tp_overlap", "pp", "cp")
# The mesh dimension every rank lies along; else dp.
DIMENSION = {"tp": "tp", "tp_overlap": "tp", "pp": "pp", "cp": "cp"}
PEER = {"dp": "DDP", "zero1": "DDP+ZeRO-1 optim", "zero2": "FSDP2 (no reshard)", "zero3": "FSDP2",
        "tp": "DTensor TP", "tp_overlap": "DTensor TP", "pp": "pipelining", "cp": "context_parallel"}
MICRO_BATCH = {"125m": 8, "1b": 4}  # sequences of 2048 tokens per forward, chosen to fit 80 GB
NO_CPU_PEER = "no CPU peer: torch's context_parallel handles only CUDA's SDPA kernels (flash, efficient, cuDNN)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", nargs="+", default=["125m", "1b"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per rank per step (pp: at least one per stage)")
    p.add_argument("--micro-batch", type=int, default=None, help="default: 8 for 125m, 4 for 1b")
    p.add_argument("--pp-schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pp: the schedule, both sides")
    p.add_argument("--steps", type=int, default=8, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per side (compilation included)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate, both sides (no warm-up)")
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer layer, both sides")
    p.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True), both sides")
    p.add_argument("--append", default=None, metavar="MD", help="append the table to this markdown file")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)  # cpu: tests
    p.add_argument("--ranks", type=int, default=2, help=argparse.SUPPRESS)  # --device cpu: processes
    p.add_argument("--rows", default=None, help=argparse.SUPPRESS)  # write the rows as JSON here
    p.add_argument("--one", nargs=3, metavar=("MODEL", "STRATEGY", "SIDE"), help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# What a side is built from, and its batches
# ----------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """Everything both sides of a strategy are built from, on this rank."""

    args: argparse.Namespace
    model_cfg: object  # minipar.model.ModelConfig
    mesh: object  # minipar.mesh.Mesh, every rank along the strategy's dimension
    device: torch.device
    train_cfg: object  # minipar.run.config.TrainConfig: lr, weight decay for param_groups

    def adamw(self, groups):
        from minipar.parallelize import adamw
        return adamw(groups, self.train_cfg.lr, fused=self.args.fused_adamw or None)

    def adamw_defaults(self) -> dict:
        from minipar.parallelize import BETAS, EPS
        return {"lr": self.train_cfg.lr, "betas": BETAS, "eps": EPS, "fused": self.args.fused_adamw or None}

    def groups_of(self, model):
        from minipar.data_parallel import param_groups
        return param_groups(model, self.train_cfg)

    def autocast(self):  # bf16 over fp32 weights on CUDA, as train.py; float32 in the CPU test mode
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()

    def compiled(self, model):
        """The model, each transformer layer's forward compiled (--compile); wrappers' hooks stay eager."""
        if self.args.compile:
            for layer in model.layers.values():
                layer.forward = torch.compile(layer.forward)
        return model

    def ddp_args(self) -> dict:
        return {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}


def micro_batches_per_step(strategy: str, args, world: int) -> int:
    return max(args.accum, world) if strategy == "pp" else args.accum  # torch's 1F1B: m >= stages


def rows_per_step(strategy: str, args, world: int, micro: int) -> int:
    """Sequences in a step's global batch: world replicas under dp and ZeRO, one under tp, pp, cp."""
    replicas = 1 if strategy in DIMENSION else world
    return replicas * micro * micro_batches_per_step(strategy, args, world)


def batches(step: int, strategy: str, args, micro: int, vocab: int, device) -> list[tuple]:
    """This rank's micro-batches of step `step`, the same random tokens for both sides: its rows
    under dp and ZeRO, all of them under tp, pp and cp (each side cuts cp's sequences itself)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = rows_per_step(strategy, args, world, micro)
    gen = torch.Generator().manual_seed(1_000_003 + step)
    tokens = torch.randint(0, vocab, (rows, args.seq_len + 1), generator=gen)
    mine = tokens if strategy in DIMENSION else tokens[rank * rows // world:(rank + 1) * rows // world]
    mine = mine.to(device)
    return list(zip(mine[:, :-1].split(micro), mine[:, 1:].split(micro)))


# ----------------------------------------------------------------------------------------------
# The two sides of each strategy: build(side, setup) -> step(micro_batches) -> loss on this rank
# ----------------------------------------------------------------------------------------------


def build_data_parallel(strategy: str, side: str, s: Setup):
    """dp and ZeRO 1-3: minipar's wrappers, or DDP / ZeroRedundancyOptimizer / FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from minipar.model import Llama
    from minipar.parallelize import build_grad_sync
    from minipar.run.train import train_step

    model, group = s.compiled(Llama(s.model_cfg, seed=0).to(s.device)), s.mesh.groups().dp
    if side == "minipar":  # every wrapper holds its optimizer (minipar/data_parallel.py's protocol)
        stage = 0 if strategy == "dp" else int(strategy[-1])
        wrapped = build_grad_sync(model, s.mesh.groups(), s.groups_of(model), s.adamw, zero=stage)
        return lambda micro: train_step(wrapped, micro, 1.0, s.autocast)[0]
    if strategy in ("dp", "zero1"):
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=group.pg, **s.ddp_args())
        opt = s.adamw(s.groups_of(model)) if strategy == "dp" else ZeroRedundancyOptimizer(
            s.groups_of(model), optimizer_class=torch.optim.AdamW, process_group=group.pg, **s.adamw_defaults())
    else:
        from torch.distributed.device_mesh import DeviceMesh

        device_mesh = DeviceMesh.from_group(group.pg, s.device.type)
        for layer in model.layers.values():
            fully_shard(layer, mesh=device_mesh, reshard_after_forward=strategy == "zero3")
        wrapped = fully_shard(model, mesh=device_mesh, reshard_after_forward=strategy == "zero3")
        opt = s.adamw(s.groups_of(model))
    return lambda micro: torch_step(wrapped, opt, micro, s.autocast)


def torch_step(model, optimizer, micro_batches, autocast, within=None) -> float:
    """PyTorch's own loop: DDP's gradients synchronised on the last micro-batch; FSDP2's reduce-scattered
    after every micro-batch, as ZeRO-2 and -3 do (a shard of the gradient, never the whole, is held between
    micro-batches); clip_grad_norm_, step. within(x, y): a context each micro-batch runs in, given its tokens
    (context_parallel)."""
    from torch.distributed.fsdp import FSDPModule

    n, total = len(micro_batches), 0.0
    for i, (x, y) in enumerate(micro_batches):
        no_sync = nullcontext() if i == n - 1 or isinstance(model, FSDPModule) else model.no_sync()
        if within is not None:
            x, y = x.clone(), y.clone()  # context_parallel cuts its buffers in place
        with no_sync, within(x, y) if within is not None else nullcontext():
            with autocast():
                loss = model(x, y) / n
            loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total)


def build_tensor_parallel(side: str, s: Setup, overlap: bool = False):
    """tp = world: minipar's tensor-parallel layers (overlap: --tp-overlap's), or the plain model under
    DTensor's plan."""
    from torch.distributed.device_mesh import init_device_mesh

    from minipar.data_parallel import DataParallel
    from minipar.model import Llama
    from minipar.parallelize import parallelize
    from minipar.run.train import train_step

    if side == "minipar":
        model = parallelize(Llama(s.model_cfg, seed=0), tp=s.mesh.groups().tp, tp_overlap=overlap)
        model = s.compiled(model.to(s.device))
        wrapped = DataParallel(model, s.mesh.groups(), optimizer=s.adamw(s.groups_of(model)))
        return lambda micro: train_step(wrapped, micro, 1.0, s.autocast)[0]
    device_mesh = init_device_mesh(s.device.type, (s.mesh.groups().tp.size,), mesh_dim_names=("tp",))
    model = s.compiled(bench.build_dtensor_model(s.model_cfg, 0, s.device, device_mesh))
    opt = s.adamw(s.groups_of(model))
    return lambda micro: bench.dtensor_train_step(model, opt, micro, 1.0, s.autocast)[0]


def build_pipeline(side: str, s: Setup):
    """pp = world, --pp-schedule on both sides: minipar's Pipeline, or torch.distributed.pipelining."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from minipar.data_parallel import DataParallel
    from minipar.model import Llama
    from minipar.parallelize import parallelize
    from minipar.pipeline.executor import Pipeline
    from minipar.run.train import train_step

    mesh, name = s.mesh, s.args.pp_schedule
    pipeline = Pipeline(mesh.groups().pp, name, s.model_cfg.n_layers, grad_group=mesh.group("pp", channel="grad"))
    stage = (pipeline.my_layers(), pipeline.holds_first(), pipeline.holds_last())
    llama = s.compiled(parallelize(Llama(s.model_cfg, seed=0), stage=stage).to(s.device))
    if side == "minipar":
        wrapped = DataParallel(llama, mesh.groups(), optimizer=s.adamw(s.groups_of(llama)))
        return lambda micro: train_step(wrapped, micro, 1.0, s.autocast, pipeline=pipeline)[0]
    m = micro_batches_per_step("pp", s.args, mesh.groups().pp.size)
    stage = PipelineStage(bench.StageModule(llama, pipeline), pipeline.group.rank, pipeline.n_stages, s.device,
                          group=mesh.groups().pp.pg)
    schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[name](
        stage, m, loss_fn=bench.mean_over_micro_batches(m, "torch", llama), scale_grads=False)
    opt = s.adamw(s.groups_of(stage.submod))

    def step(micro):
        x, y = (torch.cat(t) for t in zip(*micro))  # the schedule cuts the batch in m itself
        return bench.pipelining_train_step(schedule, stage, opt, x, y, 1.0, mesh.groups().pp, s.autocast)[0]
    return step


def build_context_parallel(side: str, s: Setup):
    """cp = world: minipar's ring attention on its zigzag shares, or torch's context_parallel
    (SDPA patched to its ring, buffers cut head-tail) with DDP averaging the cp ranks' gradients."""
    from minipar.context_parallel import split_sequence
    from minipar.data_parallel import DataParallel
    from minipar.model import Llama
    from minipar.parallelize import parallelize
    from minipar.run.train import train_step

    cp = s.mesh.groups().cp
    if side == "minipar":
        model = s.compiled(parallelize(Llama(s.model_cfg, seed=0), cp=cp).to(s.device))
        wrapped = DataParallel(model, s.mesh.groups(), optimizer=s.adamw(s.groups_of(model)))
        return lambda micro: train_step(wrapped, [(split_sequence(x, cp), split_sequence(y, cp)) for x, y in micro],
                                        1.0, s.autocast)[0]
    if s.device.type != "cuda":
        raise NotImplementedError(NO_CPU_PEER)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    model = s.compiled(Llama(s.model_cfg, seed=0).to(s.device))
    positions = torch.arange(s.args.seq_len, device=s.device)  # cut with the tokens: each rank's global positions
    for block in model.layers.values():
        block.attn.positions = lambda seq_len, device: positions
    wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=cp.pg, **s.ddp_args())
    device_mesh = init_device_mesh(s.device.type, (cp.size,), mesh_dim_names=("cp",))
    opt = s.adamw(s.groups_of(model))

    def within(x, y):
        return context_parallel(device_mesh, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 0],
                                no_restore_buffers={x, y})
    return lambda micro: torch_step(wrapped, opt, micro, s.autocast, within)


def build_side(strategy: str, side: str, s: Setup):
    if strategy in ("tp", "tp_overlap"):
        return build_tensor_parallel(side, s, overlap=strategy == "tp_overlap")
    if strategy == "pp":
        return build_pipeline(side, s)
    if strategy == "cp":
        return build_context_parallel(side, s)
    return build_data_parallel(strategy, side, s)


# ----------------------------------------------------------------------------------------------
# Measuring one side
# ----------------------------------------------------------------------------------------------


def clear_memory(device) -> int:
    """Drop what an earlier build left (compiled code holds its modules) and start the peak count.
    Returns the bytes still allocated (should be ~0: anything left would inflate the peak)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def measure(strategy, side, name, args, mesh, device, micro) -> dict:
    from minipar.model import get_config
    from minipar.run.train import TrainConfig

    base = clear_memory(device)
    s = Setup(args, get_config(name), mesh, device, TrainConfig(model=name, lr=args.lr))
    step = build_side(strategy, side, s)
    world = dist.get_world_size()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        micro_batches = batches(i, strategy, args, micro, s.model_cfg.vocab_size, device)
        dt, loss = bench.timed(step, micro_batches, device=device)
        losses.append(loss)
        if i >= args.warmup:
            times.append(dt)
    everyone = mesh.group(DIMENSION.get(strategy, "dp"))  # every rank lies along this dimension
    slowest = bench.across_ranks(times, everyone, device)  # a step lasts as long as its slowest rank
    # Each step's loss over the ranks: dp, tp and cp ranks hold shares (or copies) of one mean, the
    # pipeline's last stage holds it all (the others 0).
    summed = bench.across_ranks(losses, everyone, device, op="sum")
    losses = (summed / (1 if strategy == "pp" else world)).tolist()
    t = statistics.median(slowest.tolist())
    tokens = rows_per_step(strategy, args, world, micro) * args.seq_len
    peak = peak_flops(device)
    result = {"step_s": t, "tokens_per_s": tokens / t, "losses": losses,
              "mfu": s.model_cfg.flops_per_token(args.seq_len) * tokens / t / (world * peak) if peak else None,
              "peak_gib": (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None,
              "left_gib": base / 2**30}
    del step, s
    clear_memory(device)
    return result


def peak_flops(device) -> float | None:
    from minipar.run.run_log import peak_flops as known

    return known(device)


def mfu_convention(device) -> str:
    """What the MFU figures mean: the convention of the one FLOPs function (its docstring's first
    line, so the two cannot part) and the peak they are divided by."""
    from minipar.model import ModelConfig

    formula = ModelConfig.flops_per_token.__doc__.splitlines()[0]
    peak = peak_flops(device)
    over = f"dense bf16 peak {peak / 1e12:,.0f} TFLOP/s per GPU" if peak else "no known peak for this device: no MFU"
    return f"MFU = FLOPs per token x tokens/s / (GPUs x peak). {formula} {over}."


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def run_one(args) -> dict:
    """This process's part of one side (--one MODEL STRATEGY SIDE), under torchrun."""
    from minipar.mesh import Mesh
    from minipar.ops.hang import start_distributed

    name, strategy, side = args.one
    if args.device == "cpu":
        torch.set_num_threads(1)  # the test's ranks share the machine's cores
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        device = start_distributed()
    mesh = Mesh.build(**{DIMENSION.get(strategy, "dp"): dist.get_world_size()})
    try:
        result = measure(strategy, side, name, args, mesh, device, args.micro_batch or MICRO_BATCH.get(name, 4))
    except torch.cuda.OutOfMemoryError:
        result = {"error": "out of memory"}
    except NotImplementedError as e:
        result = {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - a bug found is a result: report it, go on
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    mesh.destroy()
    dist.destroy_process_group()
    return result


def layout_problem(strategy: str, name: str, args, world: int) -> str | None:
    """Why this strategy cannot run the model on `world` ranks, or None."""
    from minipar.model import get_config

    m = get_config(name)
    if strategy in NEEDS_TWO and world < 2:
        return f"needs 2 GPUs or more ({world} here)"
    try:
        if strategy in ("tp", "tp_overlap"):
            bench.check_dtensor_tp(m, world, name)
        if strategy == "pp" and m.n_layers < world:
            return f"{world} stages for {m.n_layers} layers"
        if strategy == "cp" and args.seq_len % (2 * world):
            return f"--seq-len {args.seq_len} is not divisible by 2 x cp = {2 * world}"
    except ValueError as e:
        return str(e)
    return None


def run_side(args, argv: list[str], world: int, name: str, strategy: str, side: str) -> dict:
    """One side in fresh processes, one per GPU (--ranks on the CPU): nothing one side leaves in
    GPU memory (compiled code, caches, fragmentation) can weigh on the next."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "side.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, *argv, "--one", name, strategy, side, "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if out.exists():
            return json.loads(out.read_text())
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-200:]}"}


def run(args, argv: list[str]) -> list[dict]:
    world = args.ranks if args.device == "cpu" else torch.cuda.device_count()
    rows = []
    for name in args.models:
        for strategy in args.strategies:
            row = {"model": name, "strategy": strategy, "world": world}
            problem = layout_problem(strategy, name, args, world)
            if problem is not None:
                rows.append(row | {"note": f"not run: {problem}"})
                print(f"{name} {strategy}: not run: {problem}", flush=True)
                continue
            for side in ("minipar", "torch"):
                row[side] = run_side(args, argv, world, name, strategy, side)
                print(f"{name} {strategy} {side}: {summary(row[side])}", flush=True)
            rows.append(row)
    return rows


def summary(side: dict) -> str:
    if "error" in side:
        return side["error"]
    mfu = f"{side['mfu']:.1%}" if side["mfu"] is not None else "n/a"
    peak = (f", peak {side['peak_gib']:.1f} GiB above {side['left_gib']:.2f} GiB left before it"
            if side["peak_gib"] is not None else "")
    return (f"{side['step_s'] * 1e3:.0f} ms/step, {side['tokens_per_s']:,.0f} tok/s, MFU {mfu}, "
            f"losses {side['losses'][0]:.5f} -> {side['losses'][-1]:.5f}{peak}")


def side_cells(side: dict) -> list[str]:
    if "error" in side:
        return [side["error"], "", ""]
    mfu = f"{side['mfu']:.1%}" if side["mfu"] is not None else "n/a"
    peak = f"{side['peak_gib']:.1f}" if side["peak_gib"] is not None else "n/a"
    return [f"{side['tokens_per_s']:,.0f}", mfu, peak]


def table(rows: list[dict], args, device_name: str) -> str:
    out = [f"\n### GPU run: {device_name} x {rows[0]['world'] if rows else 0}, "
           f"{datetime.date.today()}, torch {torch.__version__}\n",
           f"`python scripts/bench/bench_gpu.py {' '.join(sys.argv[1:])}` — "
           f"{'bf16 autocast over fp32 weights' if args.device == 'cuda' else 'float32 on gloo'}, seq "
           f"{args.seq_len}, {args.accum} micro-batches per step (pp: at least one per stage, schedule "
           f"{args.pp_schedule}), compile {'on' if args.compile else 'off'}, fused AdamW "
           f"{'on' if args.fused_adamw else 'off'}\n",
           f"{mfu_convention(torch.device(args.device))}\n",
           "| model | strategy | peer | minipar tok/s | minipar MFU | minipar peak GiB | peer tok/s | peer MFU "
           "| peer peak GiB | ratio | loss diff: step 1 / max |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "note" in r:
            out.append(f"| {r['model']} | {r['strategy']} | {PEER[r['strategy']]} | {r['note']} | | | | | | | |")
            continue
        a, b = r["minipar"], r["torch"]
        cells = side_cells(a) + side_cells(b)
        ok = "error" not in a and "error" not in b
        ratio = f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}x" if ok else "-"
        diff = (f"{abs(a['losses'][0] - b['losses'][0]):.2g} / "
                f"{max(abs(x - y) for x, y in zip(a['losses'], b['losses'])):.2g}") if ok else "-"
        out.append(f"| {r['model']} | {r['strategy']} | {PEER[r['strategy']]} | {' | '.join(cells)} | {ratio} "
                   f"| {diff} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench-gpu: no GPU (torch.cuda.is_available() is False): nothing to measure")
        return 0
    if args.one:  # one side, in the processes the orchestrator below started
        result = run_one(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.json).write_text(json.dumps(result))
        return 0
    print(mfu_convention(torch.device(args.device)), flush=True)  # before the run: a run cut short still says it
    rows = run(args, [a for a in argv if a not in ("--append", args.append, "--rows", args.rows)])
    if args.rows:
        Path(args.rows).write_text(json.dumps(rows))
    text = table(rows, args, torch.cuda.get_device_name() if args.device == "cuda" else "cpu (gloo, float32)")
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text)
        print(f"appended to {args.append}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
