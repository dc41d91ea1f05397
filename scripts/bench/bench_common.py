"""What the benchmarks share: starting the ranks, timing a step, reducing and summarising the times,
printing the comparison and writing the JSON.

bench_dp.py, bench_tp.py, bench_pp.py and bench_zero.py train minipar and PyTorch's own
implementation side by side in one launch, in turn, step by step; bench_cp.py runs ring attention
against attention on one device the same way, and bench_ep.py expert parallelism against
replicated experts (minipar's DataParallel and DDP) and a dense model of the same active size;
bench_muon.py minipar's Muon against DDP with torch.optim.Muon, and its owner method against gather.
Each compares the slowest rank's step times. The measuring rules live here, once, so that every
benchmark measures the same way:

    start         torch threads: the machine's cores shared among the ranks on it; then the
                  process group (NCCL and cuda:LOCAL_RANK with CUDA, else gloo on the CPU), the mesh
    timed         one step from a barrier, so that all ranks begin together; on GPUs the queued
                  kernels are waited for (torch.cuda.synchronize) before the clock starts and stops
    take_turns    warm-up and measured steps of every side, the order reversed at every step
    across_ranks  a step lasts as long as its slowest rank: per-rank figures reduced over a group
    step_stats    median / min / max (and tokens per second at the median)
    ratios        the ratio of the medians, and the median of the step-by-step ratios
    table_row...  the comparison as rank 0 prints it; write_json, the results for --json

PyTorch's own sides live here too, so that the CPU benchmarks and bench_gpu.py measure the very
same peers (bench_tp.py and bench_pp.py explain each choice):

    DTensor TP    dtensor_tp_plan, build_dtensor_model, dtensor_train_step (clip_grad_norm_mixed)
    pipelining    StageModule, mean_over_micro_batches, pipelining_train_step

(bench_gpu.py starts every side in fresh processes of its own and keeps its own loop.) Not a
script: the benchmarks import it (`scripts/bench/` is on sys.path when one of them runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from minipar.collectives import Group, Ledger, all_reduce
from minipar.data_parallel import clip_grads
from minipar.mesh import Mesh
from minipar.model import CONFIGS, Block, Llama, ModelConfig
from minipar.ops.hang import start_distributed
from minipar.run.config import TrainConfig

# ----------------------------------------------------------------------------------------------
# Starting
# ----------------------------------------------------------------------------------------------


class TorchDDP(DistributedDataParallel):
    """PyTorch's DDP, given the part of minipar's gradient-sync protocol that train_step calls
    (minipar/data_parallel.py): the optimizer it holds, its group, finish_grad_sync, clip_and_step.

    DDP waits for its own all-reduces at the end of backward (a callback it queues in the autograd
    engine), so when train_step calls finish_grad_sync there is nothing left to do. clip_and_step
    is DataParallel's at tp = pp = 1: the same clip_grads on the same gradients, then the step.
    With them, both sides run the very same train_step.
    """

    def __init__(self, module, optimizer: torch.optim.Optimizer, group: Group, **ddp_args):
        super().__init__(module, process_group=group.pg, **ddp_args)
        self.optimizer, self.group = optimizer, group  # train_step counts the batch's targets over group

    def finish_grad_sync(self) -> None:
        pass

    def clip_and_step(self, max_norm: float, pp_group: Group | None = None, gate=None) -> float | None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if gate is not None and not gate(grads):  # as DataParallel's: dropped, nothing stepped
            self.optimizer.zero_grad(set_to_none=True)
            return None
        norm = clip_grads(grads, [()] * len(grads), max_norm, [pp_group])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm



def command_line(doc: str, sides: str, steps: int, warmup: int, warmup_note: str = "") -> argparse.ArgumentParser:
    """A benchmark's options, begun with those every one takes: the model, the measured and the
    unmeasured steps (of each of the `sides`), the sequence length. parse() adds --seed and --json."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="named model size")
    p.add_argument("--steps", type=int, default=steps, help=f"measured optimizer steps, each of the {sides}")
    p.add_argument("--warmup", type=int, default=warmup,
                   help=f"unmeasured optimizer steps first, each of the {sides}{warmup_note}")
    p.add_argument("--seq-len", type=int, default=128)
    return p


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    p.add_argument("--seed", type=int, default=0, help="model weights and token batches")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p.parse_args(argv)


def world_size() -> int:
    """torchrun's WORLD_SIZE: known before any process group exists, so the layout can be checked first."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def valid(script: str, *checks: Callable[[], object]) -> bool:
    """Run each check (it raises ValueError with the reason) before any process group exists.
    False, after rank 0 has said why on stderr, if one fails: the script then exits 2."""
    try:
        for check in checks:
            check()
    except ValueError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{script}: error: {e}", file=sys.stderr)
        return False
    return True


def threads_per_rank() -> int:
    """The machine's cores divided among the ranks on it (torchrun's LOCAL_WORLD_SIZE)."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def start(**dims: int) -> tuple[torch.device, Mesh]:
    """Set this rank's torch threads, join the process group and build the mesh of `dims` (dp=...,
    tp=...). Returns the device to use and the mesh."""
    torch.set_num_threads(threads_per_rank())  # threads beyond a rank's share of the cores only contend
    device = start_distributed()
    return device, Mesh.build(**dims)


def machine(device: torch.device) -> dict:
    """Where the run took place, as every results file records it."""
    return {"backend": dist.get_backend(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "threads_per_rank": torch.get_num_threads()}


def finish(mesh: Mesh) -> None:
    mesh.destroy()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Batches: random tokens, the same on every rank and for every side
# ----------------------------------------------------------------------------------------------


def random_batch(step: int, seed: int, rows: int, seq_len: int, vocab: int, device) -> tuple[torch.Tensor, ...]:
    """The tokens of step `step`: inputs [rows, seq_len] and targets, the inputs shifted by one
    (as the data pipeline gives them)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def rank_micro_batches(step: int, cfg: TrainConfig, vocab: int, rank: int, device) -> list[tuple]:
    """This dp rank's micro-batches of step `step`: its rows of the global batch, cut in micro-batches."""
    x, y = random_batch(step, cfg.seed, cfg.global_batch, cfg.seq_len, vocab, device)
    rows = cfg.global_batch // cfg.dp
    mine = slice(rank * rows, (rank + 1) * rows)  # [b/dp, s]
    return list(zip(x[mine].split(cfg.micro_batch), y[mine].split(cfg.micro_batch), strict=True))


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def barrier(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # nothing earlier may still be running when the clock starts
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def timed(fn: Callable, *args, device: torch.device, at_start: Callable[[], None] | None = None):
    """fn(*args) from a barrier: (seconds on this rank, what fn returned). at_start runs after the
    barrier, just before the clock starts (to begin a memory measurement, say)."""
    barrier(device)
    if at_start is not None:
        at_start()
    t0 = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()  # CUDA kernels run asynchronously: wait for the step's last one
    return time.perf_counter() - t0, out


def turns(sides: list, step: int) -> list:
    """The order the sides run in at step `step`: forward on even steps, reversed on odd ones (a b,
    b a, ...), so that machine noise and any penalty for going first or second hit all of them alike."""
    return list(sides) if step % 2 == 0 else list(sides)[::-1]


def take_turns(sides: dict[object, Callable], batch_of: Callable[[int], tuple], warmup: int, steps: int, device,
               ledger: Ledger, after: Callable[[object, bool], None] | None = None) -> tuple[dict, dict]:
    """`warmup` unmeasured steps, then `steps` measured ones, of every side in turn.

    sides: {side: step function}; a step function takes the step's batch, batch_of(step) (a tuple of
    arguments), and returns (loss, gradient norm) as train_step does. The ledger is reset before
    each step, so that after(side, measured), called right after it, reads that step's traffic.
    Returns ({side: this rank's measured step times}, {side: the loss of every step}).
    """
    times = {side: [] for side in sides}
    losses = {side: [] for side in sides}
    for step in range(warmup + steps):
        batch = batch_of(step)
        for side in turns(sides, step):
            ledger.reset()
            dt, (loss, _) = timed(sides[side], *batch, device=device)
            losses[side].append(loss)
            if step >= warmup:
                times[side].append(dt)
            if after is not None:
                after(side, step >= warmup)
    return times, losses


# ----------------------------------------------------------------------------------------------
# Summing up
# ----------------------------------------------------------------------------------------------


def across_ranks(values, group: Group, device, op: str = "max") -> torch.Tensor:
    """Per-rank figures (numbers, or lists of equal length) reduced over the group, float64, on the
    CPU. With op "max" on step times: a step takes as long as its slowest rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    all_reduce(t, group, op=op)
    return t.cpu()


def step_stats(times: list[float], tokens_per_step: int | None = None) -> dict:
    """Median, min and max of the step times (tokens per second at the median), then the times."""
    median = statistics.median(times)
    stats = {"median_step_s": median, "min_step_s": min(times), "max_step_s": max(times)}
    if tokens_per_step is not None:
        stats["tokens_per_s"] = tokens_per_step / median
    return stats | {"step_times_s": times}


def ratios(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """(ratio of the median step times, median of the step-by-step ratios) of two sides. The two
    steps of a pair ran back to back on the same batch, so the second figure is less sensitive to
    slow drifts in the machine's load."""
    medians = statistics.median(ours.tolist()) / statistics.median(theirs.tolist())
    return medians, statistics.median((ours / theirs).tolist())


# ----------------------------------------------------------------------------------------------
# Reporting (rank 0)
# ----------------------------------------------------------------------------------------------

TOKENS_COLUMN = f"{'tokens/s':>11}"


def table_header(width: int, tail: str = TOKENS_COLUMN) -> str:
    """The columns of the comparison, after a label column `width` wide."""
    return f"{'':<{width}}{'median step':>13}{'min':>11}{'max':>11}{tail}"


def table_row(label: str, stats: dict, width: int) -> str:
    """One side's row: its step_stats in milliseconds (and tokens/s, when it has them)."""
    row = (f"{label:<{width}}{stats['median_step_s'] * 1e3:>10.1f} ms{stats['min_step_s'] * 1e3:>8.1f} ms"
           f"{stats['max_step_s'] * 1e3:>8.1f} ms")
    return row + (f"{stats['tokens_per_s']:>11,.0f}" if "tokens_per_s" in stats else "")


def ratio_line(label: str, ratio: float, paired: float, width: int) -> str:
    """The ratio minipar / PyTorch (goal <= 1.0x), under the median column of a table `width` wide."""
    figure = width + 10 - len(label) - 1  # the figure ends where the rows' median figures end
    return (f"{label} {ratio:>{figure}.3f}x   (goal: <= 1.0x); "
            f"median of step-by-step ratios {paired:.3f}x")


def write_json(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------
# PyTorch's tensor parallelism: the plain Llama under a DTensor plan (bench_tp.py, bench_gpu.py)
# ----------------------------------------------------------------------------------------------


def check_dtensor_tp(m: ModelConfig, tp: int, model: str) -> None:
    """ColwiseParallel cuts wk and wv into tp equal row blocks: with fewer kv heads than ranks a
    block would be part of a head (minipar replicates them then; DTensor has no such style).
    Raises ValueError when tp does not divide a size the plan cuts."""
    for name, size in (("attention heads", m.n_heads), ("kv heads", m.n_kv_heads), ("hidden size", m.dim),
                       ("MLP size", m.ffn_dim), ("vocabulary", m.vocab_size)):
        if size % tp:
            raise ValueError(f"tp {tp} does not divide the model's {size} {name} (--model {model}): "
                             f"run on a number of ranks (--nproc-per-node, GPUs) that divides it")


def dtensor_tp_plan(model: nn.Module) -> dict:
    """torchtitan's Llama plan without sequence parallelism (bench_tp.py's docstring has the table)."""
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
    }
    for layer in (name for name, m in model.named_modules() if isinstance(m, Block)):  # "layers.0", ...
        plan |= {
            # attn(x), mlp(x): x becomes one replicated DTensor that the linears share.
            f"{layer}.attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            f"{layer}.attn.wq": ColwiseParallel(),
            f"{layer}.attn.wk": ColwiseParallel(),
            f"{layer}.attn.wv": ColwiseParallel(),
            f"{layer}.attn.wo": RowwiseParallel(),
            f"{layer}.mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            f"{layer}.mlp.w_gate": ColwiseParallel(),
            f"{layer}.mlp.w_up": ColwiseParallel(),
            f"{layer}.mlp.w_down": RowwiseParallel(),
        }
    return plan


def build_dtensor_model(config, seed: int, device, device_mesh) -> nn.Module:
    """The plain Llama, parallelised by torch. Each attention then sees h/tp heads in its local
    projections' outputs, and reshapes by them: nothing of the model needs setting after."""
    model = Llama(config, seed=seed).to(device)
    return parallelize_module(model, device_mesh, dtensor_tp_plan(model))


def clip_grad_norm_mixed(params, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a model whose parameters are partly DTensors.

    clip_grad_norm_ itself raises "got mixed torch.Tensor and DTensor" here (the norm gains are
    plain, replicated tensors), so: the norm of each kind (the DTensor one is reduced over tp by
    DTensor), combined, then each kind clipped by the same total.
    """
    params = [p for p in params if p.grad is not None]
    kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    kinds = [k for k in kinds if k]
    norms = [torch.nn.utils.get_total_norm([p.grad for p in k]) for k in kinds]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    for k in kinds:
        torch.nn.utils.clip_grads_with_norm_(k, max_norm, total)
    return total


def dtensor_train_step(model: nn.Module, optimizer, micro_batches, grad_clip: float,
                       autocast=nullcontext) -> tuple[float, float]:
    """One optimizer step, torch's way, over the micro-batches (every tp rank sees all of them).
    Returns (loss, gradient norm), like minipar's train_step."""
    total, n = 0.0, len(micro_batches)
    for x, y in micro_batches:
        with loss_parallel():  # cross_entropy on vocabulary-sharded logits; its backward must be inside too
            with autocast():
                logits = model(x).float()  # DTensor [b, s, V], Shard(-1): each rank holds V/tp columns
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / n
            loss.backward()
        total = total + loss.detach().full_tensor()
    grad_norm = clip_grad_norm_mixed(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total), float(grad_norm)


# ----------------------------------------------------------------------------------------------
# torch.distributed.pipelining: minipar's stage Llama as a PipelineStage (bench_pp.py, bench_gpu.py)
# ----------------------------------------------------------------------------------------------


class StageModule(nn.Module):
    """One stage for PipelineStage: minipar's stage Llama, returning the activations for the next
    stage, or on the last stage the logits (the schedule's loss_fn computes the loss). `pipeline`
    is the minipar Pipeline of the same layout: it says which layers this rank holds."""

    def __init__(self, llama: Llama, pipeline):
        super().__init__()
        self.llama = llama
        self.layer_ids, self.first, self.last = pipeline.my_layers(), pipeline.holds_first(), pipeline.holds_last()

    def forward(self, x):  # tokens [b, s] or activations [b, s, d] -> [b, s, d], or logits [b, s, V]
        return self.llama.forward_stage(x, self.layer_ids, first=self.first, last=self.last)


def mean_over_micro_batches(m: int, cross_entropy: str, llama: Llama):
    """loss_fn for torch's schedules: each micro-batch's mean cross-entropy / m, as minipar's.

    cross_entropy "torch" is F.cross_entropy (on logits in at least float32, as minipar's loss);
    "minipar" is the function minipar's last stage calls, `llama.loss_fn` (at tp = 1 the plain
    model's cross_entropy), so that only the pipelines differ."""

    def loss_fn(logits, targets):  # [b, s, V], [b, s]
        if cross_entropy == "minipar":
            return llama.loss_fn(logits, targets) / m
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / m
    return loss_fn


def pipelining_train_step(schedule, stage, optimizer, x, y, grad_clip: float, pp_group: Group,
                          autocast=nullcontext) -> tuple[float, float]:
    """torch's pipeline, then train_step's tail (minipar's clip_grads: one all-reduce over pp).
    Returns (loss on the last stage, else 0, gradient norm)."""
    losses = []
    inputs = (x,) if stage.is_first else ()
    with autocast():  # as minipar's train_step runs its pipeline: forward and backward inside
        schedule.step(*inputs, target=y if stage.is_last else None, losses=losses, return_outputs=False)
    grads = [p.grad for p in stage.submod.parameters() if p.grad is not None]
    grad_norm = clip_grads(grads, [()] * len(grads), grad_clip, [pp_group])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(sum(loss.detach() for loss in losses)) if losses else 0.0, grad_norm
