"""Benchmark: minipar's hand-written tensor parallelism against PyTorch's DTensor tensor parallelism.

    torchrun --standalone --nproc-per-node 2 scripts/bench/bench_tp.py                  # about 2 minutes on 2 CPU cores
    torchrun --standalone --nproc-per-node 4 scripts/bench/bench_tp.py --model 125m --json tp.json   # 4 GPUs (NCCL)

One launch trains two copies of the same model side by side, every rank a tp rank (tp = world, dp = 1):

    (a) minipar   parallelize(Llama(config, seed), tp=mesh.groups().tp): the plain Llama(config, seed)
                  with its layers swapped for minipar's tensor-parallel ones, each holding its shard;
                  DataParallel(model, mesh.groups(), optimizer=...) (no traffic at dp = 1);
                  step: minipar.run.train.train_step
    (b) PyTorch   the same plain Llama(config, seed), then parallelize_module(model, device_mesh, plan)
                  (bench_common.dtensor_tp_plan); step: `bench_common.dtensor_train_step`,
                  written with torch's own tools

The DTensor plan is torchtitan's Llama plan with sequence parallelism left out (Replicate where
torchtitan has Shard(1)), and puts every collective where minipar puts it:

    module                  DTensor style                                    minipar
    tok_emb                 RowwiseParallel(input_layouts=Replicate())        VocabParallelEmbedding
                            vocabulary rows sharded, partial sums all-reduced  (the same: g after the lookup)
    layers.i.attn, .mlp     PrepareModuleInput(Replicate -> Replicate)        enter_parallel_region (f)
                            the block input becomes one replicated DTensor, so
                            its gradient is all-reduced once, not per linear
    wq wk wv, w_gate w_up   ColwiseParallel()                                 ColumnParallelLinear
    wo, w_down              RowwiseParallel()  (all-reduce forward)           RowParallelLinear (g)
    lm_head                 ColwiseParallel(output_layouts=Shard(-1),          ColumnParallelLinear
                              use_local_output=False)
    loss                    F.cross_entropy under loss_parallel()             vocab_parallel_cross_entropy
                            (sharded logits, per-token max / sum-exp / target  (the same three [N]
                            logit reduced across ranks: [b, s, V] never built)   all-reduces)

Linear outputs come back as plain local tensors (use_local_output=True), so minipar's Attention,
MLP and Block code runs unchanged on the DTensor side. The attention reads its head counts off the
shapes of the q, k and v projections' outputs, here the local [b, s, h/tp * hd]: each rank runs its
n_heads / tp heads with nothing to set (torchtitan must set them by hand, its model stores them).
The plain model is made of nn.Linear and nn.Embedding, the only classes parallelize_module's styles
accept, so it is parallelised as it is.

Both sides start from the same weights (a shard of minipar's is the slice of the single-device
tensor), see the same random batches, and step with the same AdamW (parallelize.adamw on the
param_groups of one TrainConfig: lr 3e-3, weight decay 0.1 on matrices) and gradient clipping at 1.0. PyTorch's
clip_grad_norm_ refuses a list that mixes DTensors with plain tensors (the replicated norm gains
stay plain here), so the DTensor side takes the total norm of each kind with
torch.nn.utils.get_total_norm and clips both with clip_grads_with_norm_. Steps alternate (a b, b a,
...) after `--warmup` unmeasured steps each; each starts from a barrier, is timed with
time.perf_counter (after torch.cuda.synchronize on GPUs), and lasts as long as its slowest rank.

Rank 0 prints the median step times, the ratio minipar / DTensor (the goal is <= 1.0x), the
collectives one rank issues per step on each side (minipar's ledger; for DTensor, counted in the
first warm-up step by `CollectiveCounter` and converted to bytes sent with the ledger's own ring
formula), and checks that both sides computed the same thing: before the run, the gradients of one
forward and backward on the first batch, gathered whole, must agree to float32 rounding (relative
difference ~1e-6); the losses of the first steps too. The losses of later steps and the parameters
at the end are printed as well: they drift apart slowly, as any two float32 implementations do
(AdamW divides by sqrt(v), so a rounding-level change in a near-zero gradient entry can move
that weight by up to lr per step), so those differences are for scale, not for equality.

Backend: NCCL and cuda:LOCAL_RANK when CUDA is available, else gloo on CPU, with torch threads set
to the cores per rank. Both sides compute in float32.

`--overlap` compares minipar with itself instead: the blocking tensor parallelism above (side a)
against `parallelize(..., tp_overlap=True)` (train.py's --tp-overlap: each region's backward posts its
all-reduce, computes the weight gradients while it travels, then waits; autograd_ops.py), both from
the same weights, on the same batches, taking turns as above:

    torchrun --standalone --nproc-per-node 2 scripts/bench/bench_tp.py --overlap --steps 40 # 1-2 minutes on 2 CPU cores

Besides the step times it prints the exposed tp time of each: the seconds a rank spends blocked on a
collective, inside a synchronous one or in the wait() of an asynchronous one's handle (ExposedClock;
the mean over the ranks of each step, then the median over steps). It checks that the two computed
the same thing, bitwise: every step's loss equal, and the same ledger every step. The exposed time is
a host clock: on CPU (gloo) it is the time lost, on GPUs (NCCL) the host does not wait, and only the
step times tell.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from functools import partial

import bench_common as bench
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from minipar.collectives import ring_bytes_sent
from minipar.data_parallel import DataParallel, param_groups
from minipar.mesh import Mesh
from minipar.model import CONFIGS, Llama, get_config
from minipar.parallelize import adamw, parallelize
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.train import train_step
from minipar.tensor_parallel import unshard


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.command_line(__doc__, "two", steps=100, warmup=5, warmup_note=" (the first counts DTensor's collectives)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (every tp rank sees all of them)")
    p.add_argument("--overlap", action="store_true", help="compare minipar's blocking tp with its overlapped tp "
                   "(--tp-overlap), not with DTensor")
    return bench.parse(p, argv)


def check_layout(args, world: int) -> None:
    """Refuse, with the reason, what one of the two sides cannot do."""
    if args.steps < 1 or args.warmup < 1:
        raise ConfigError("--steps and --warmup must be at least 1 (the first warm-up step counts collectives)")
    if args.batch < 1 or args.seq_len < 1:
        raise ConfigError("--batch and --seq-len must be at least 1")
    m = CONFIGS[args.model]
    if args.seq_len > m.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the model's {m.max_seq_len}")
    if not args.overlap:
        bench.check_dtensor_tp(m, world, args.model)  # the DTensor plan (bench_common.dtensor_tp_plan) cuts these
    elif world < 2:
        raise ConfigError("--overlap needs 2 ranks or more: at tp 1 there is no message to hide")


# ----------------------------------------------------------------------------------------------
# The DTensor side: bench_common.build_dtensor_model and dtensor_train_step, and a counter of its
# collectives
# ----------------------------------------------------------------------------------------------


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives DTensor issues (its functional collectives), with the ledger's bytes.

    DTensor turns each redistribution into a _c10d_functional op on plain tensors; this mode lets
    DTensor run first (it returns NotImplemented for DTensor arguments) and sees those ops.
    """

    OPS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
           "broadcast_": "broadcast"}

    def __init__(self, group_size: int):
        super().__init__()
        self.n = group_size
        self.entries = defaultdict(lambda: {"calls": 0, "bytes": 0, "sent": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) == "_c10d_functional" and func._opname in self.OPS:
            op = self.OPS[func._opname]
            t = args[0]
            nbytes = t.numel() * t.element_size() * (self.n if op == "all_gather" else 1)  # ledger: S = output
            e = self.entries[f"tp/{op}"]
            e["calls"] += 1
            e["bytes"] += nbytes
            e["sent"] += ring_bytes_sent(op, nbytes, self.n)
        return out


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def gradient_difference(ours: DataParallel, theirs: nn.Module, x, y, tp_group) -> float:
    """Largest, over parameters, of max |grad minipar - grad DTensor| / max |grad DTensor| for one
    forward and backward on (x, y), gradients gathered whole; both models' gradients are then dropped.

    The direct check that both sides compute the same thing: AdamW later amplifies rounding in the
    entries whose gradient is near zero, so parameters after many steps agree less closely.
    """
    ours(x, y).backward()
    with loss_parallel():
        F.cross_entropy(theirs(x).flatten(0, 1), y.flatten()).backward()
    worst = 0.0
    with torch.no_grad():
        full_theirs = {n: p.grad.full_tensor() if isinstance(p, DTensor) else p.grad
                       for n, p in theirs.named_parameters()}
        for n, p in ours.module.named_parameters():
            g = unshard(p.grad, p, tp_group)
            worst = max(worst, ((g - full_theirs[n]).abs().max() / full_theirs[n].abs().max()).item())
    ours.module.zero_grad(set_to_none=True)
    theirs.zero_grad(set_to_none=True)
    ours.finish_grad_sync()  # a no-op at dp = 1; keeps the wrapper's bookkeeping clean
    return worst


def build_sides(cfg: TrainConfig, model_cfg, mesh: Mesh, device) -> tuple:
    """Both models from the same weights, each with an AdamW of its own from the same TrainConfig.
    Returns (minipar's model, the DTensor model, {side: step function})."""
    device_mesh = init_device_mesh(device.type, (mesh.groups().tp.size,), mesh_dim_names=("tp",))
    model = parallelize(Llama(model_cfg, seed=cfg.seed), tp=mesh.groups().tp).to(device)
    ours = DataParallel(model, mesh.groups(), optimizer=adamw(param_groups(model, cfg), cfg.lr))
    theirs = bench.build_dtensor_model(model_cfg, cfg.seed, device, device_mesh)
    opt_theirs = adamw(param_groups(theirs, cfg), cfg.lr)
    steps = {
        "minipar": lambda x, y: train_step(ours, [(x, y)], cfg.grad_clip),
        "dtensor": lambda x, y: bench.dtensor_train_step(theirs, opt_theirs, [(x, y)], cfg.grad_clip),
    }
    return ours, theirs, steps


def counted_once(step_fn, counter: CollectiveCounter):
    """step_fn, its first call under the counter: DTensor's collectives are counted in the first
    (unmeasured) step."""
    pending = [counter]

    def step(x, y):
        with pending.pop() if pending else nullcontext():
            return step_fn(x, y)
    return step


def run_steps(steps: dict, args, vocab: int, mesh: Mesh, device) -> dict:
    """Both sides in turn on the same batches. Returns this rank's measured step times and the losses
    of every step, per side; minipar's bytes sent per step (the ledger); DTensor's counted collectives."""
    counter = CollectiveCounter(mesh.groups().tp.size)
    steps = steps | {"dtensor": counted_once(steps["dtensor"], counter)}
    traffic = {"sent": [], "ledger": {}}

    def note(side: str, measured: bool) -> None:  # right after each step, warm-up included
        if side == "minipar":
            traffic["sent"].append(mesh.ledger.total_sent())
            traffic["ledger"] = mesh.ledger.snapshot()

    def batch(step: int) -> tuple:
        return bench.random_batch(step, args.seed, args.batch, args.seq_len, vocab, device)

    times, losses = bench.take_turns(steps, batch, args.warmup, args.steps, device, mesh.ledger, note)
    return {"times": times, "losses": losses, "dtensor_comm": dict(sorted(counter.entries.items()))} | traffic


def summarise(run: dict, ours, theirs, grad_diff: float, args, mesh: Mesh, device) -> dict:
    """The results on every rank: the slowest rank's step times, and how far apart the sides' losses
    and parameters are."""
    step_times = bench.across_ranks([run["times"]["minipar"], run["times"]["dtensor"]], mesh.groups().tp, device)
    # The same computation? Every parameter, gathered whole on every rank, compared by name.
    with torch.no_grad():
        full_theirs = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in theirs.named_parameters()}
        param_diff = max((unshard(p.detach(), p, mesh.groups().tp) - full_theirs[n]).abs().max().item()
                         for n, p in ours.module.named_parameters())
    losses = run["losses"]
    loss_rel = [abs(a - b) / abs(b) for a, b in zip(losses["minipar"], losses["dtensor"], strict=True)]
    dtensor_comm = run["dtensor_comm"]
    results = {
        "model": args.model, "params": get_config(args.model).num_params(), "tp": mesh.groups().tp.size,
        **bench.machine(device),
        "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq_len": args.seq_len,
        "minipar_bytes_sent_per_step": statistics.median(run["sent"]), "minipar_ledger": run["ledger"],
        "dtensor_bytes_sent_per_step": sum(e["sent"] for e in dtensor_comm.values()), "dtensor_comm": dtensor_comm,
        "first_loss": {"minipar": losses["minipar"][0], "dtensor": losses["dtensor"][0]},
        "first_loss_rel_diff": loss_rel[0], "max_loss_rel_diff_first_10": max(loss_rel[:10]),
        "max_loss_rel_diff": max(loss_rel),
        "first_grad_max_rel_diff": grad_diff, "max_abs_param_diff": param_diff,
    }
    for name, t in zip(("minipar", "dtensor"), step_times, strict=True):
        results[name] = bench.step_stats(t.tolist(), args.batch * args.seq_len)
    results["ratio_minipar_over_dtensor"], results["median_paired_ratio"] = bench.ratios(step_times[0], step_times[1])
    return results


def calls(entries: dict) -> str:
    return ", ".join(f"{k} {e['calls']} calls, payload {e['bytes'] / 2**20:.2f} MiB" for k, e in entries.items())


def report(r: dict, args) -> None:
    print(f"model {r['model']} ({r['params'] / 1e6:.2f}M params, float32) | tp {r['tp']} (dp 1), {r['backend']}, "
          f"{r['device']}, {r['threads_per_rank']} thread(s)/rank | batch {args.batch} x "
          f"{args.seq_len} tokens | {args.steps} measured steps each after {args.warmup} warm-up")
    print(bench.table_header(22))
    for name, label in (("minipar", "minipar TP"), ("dtensor", "torch DTensor TP")):
        print(bench.table_row(label, r[name], 22))
    print(bench.ratio_line("ratio minipar / DTensor", r["ratio_minipar_over_dtensor"], r["median_paired_ratio"], 22))
    print("collectives per step, one rank (sent: by the ring formula of minipar's ledger)")
    for label, key, entries in (("minipar (ledger)", "minipar", r["minipar_ledger"]),
                                ("DTensor (counted)", "dtensor", r["dtensor_comm"])):
        print(f"  {label:<20}{r[key + '_bytes_sent_per_step'] / 2**20:>6.2f} MiB sent; {calls(entries)}")
    print(f"gradients of the first batch: max |minipar - DTensor| / max |DTensor|, worst parameter: "
          f"{r['first_grad_max_rel_diff']:.2g}")
    first = r["first_loss"]
    print(f"loss, relative difference: step 1 {r['first_loss_rel_diff']:.2g} (minipar {first['minipar']:.7f}, "
          f"DTensor {first['dtensor']:.7f}), largest in steps 1-10 {r['max_loss_rel_diff_first_10']:.2g}, "
          f"in all {args.warmup + args.steps} steps {r['max_loss_rel_diff']:.2g}")
    print(f"after {args.warmup + args.steps} steps: max |param minipar - param DTensor| = "
          f"{r['max_abs_param_diff']:.3g} (float32 drift, for scale: see the docstring)")
    bench.write_json(args.json, r)


# ----------------------------------------------------------------------------------------------
# --overlap: minipar's blocking tp against its overlapped tp, and the time each waits on messages
# ----------------------------------------------------------------------------------------------


class ExposedClock:
    """Seconds this rank spends blocked on collectives since `reset`: the whole of a synchronous one,
    the wait() of an asynchronous one; `seconds[1]`: those of them inside backward (autograd running
    a node). Installed over torch.distributed's three collectives that minipar's tp layers call
    (collectives.py calls them through `dist.`)."""

    OPS = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self):
        self.seconds, self.real = [0.0, 0.0], {op: getattr(dist, op) for op in self.OPS}
        for op in self.OPS:
            setattr(dist, op, partial(self._call, op))

    def reset(self) -> None:
        self.seconds = [0.0, 0.0]

    def add(self, start: float) -> None:
        self.seconds[0] += time.perf_counter() - start
        if torch._C._current_autograd_node() is not None:  # in backward
            self.seconds[1] += time.perf_counter() - start

    def _call(self, name: str, *args, async_op: bool = False, **kwargs):
        start = time.perf_counter()
        work = self.real[name](*args, async_op=async_op, **kwargs)
        if async_op:
            return ExposedClock.Timed(work, self)
        self.add(start)
        return work

    class Timed:
        """A work handle whose wait() is counted."""

        def __init__(self, work, clock: ExposedClock):
            self.work, self.clock = work, clock

        def wait(self):
            start = time.perf_counter()
            done = self.work.wait()
            self.clock.add(start)
            return done


def overlap_run(args, cfg: TrainConfig, model_cfg, mesh: Mesh, device) -> dict:
    """Both of minipar's tp sides in turn: this rank's step times, exposed tp seconds, losses and
    ledgers per side."""
    steps = {}
    for side, overlap in (("blocking", False), ("overlapped", True)):
        model = parallelize(Llama(model_cfg, seed=cfg.seed), tp=mesh.groups().tp, tp_overlap=overlap).to(device)
        wrapped = DataParallel(model, mesh.groups(), optimizer=adamw(param_groups(model, cfg), cfg.lr))
        steps[side] = partial(lambda w, x, y: train_step(w, [(x, y)], cfg.grad_clip), wrapped)
    clock = ExposedClock()
    exposed, ledgers = {side: [] for side in steps}, {side: [] for side in steps}

    def note(side: str, measured: bool) -> None:  # right after each step; the ledger and clock start at 0
        if measured:
            exposed[side].append(clock.seconds)
        ledgers[side].append(mesh.ledger.snapshot())
        clock.reset()

    def batch(step: int) -> tuple:
        return bench.random_batch(step, args.seed, args.batch, args.seq_len, model_cfg.vocab_size, device)

    times, losses = bench.take_turns(steps, batch, args.warmup, args.steps, device, mesh.ledger, note)
    return {"times": times, "exposed": exposed, "losses": losses, "ledgers": ledgers}


def overlap_summary(run: dict, args, mesh: Mesh, device) -> dict:
    tp = mesh.groups().tp
    sides = ("blocking", "overlapped")
    step_times = bench.across_ranks([run["times"][s] for s in sides], tp, device)  # the slowest rank's
    # [side, step, (all, in backward)]: the mean over ranks
    exposed = bench.across_ranks([run["exposed"][s] for s in sides], tp, device, op="sum") / tp.size
    r = {"model": args.model, "params": get_config(args.model).num_params(), "tp": tp.size, **bench.machine(device),
         "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq_len": args.seq_len,
         "losses_bitwise_equal": run["losses"]["blocking"] == run["losses"]["overlapped"],
         "ledgers_equal": run["ledgers"]["blocking"] == run["ledgers"]["overlapped"],
         "ledger_per_step": run["ledgers"]["blocking"][-1]}
    for i, side in enumerate(sides):
        r[side] = bench.step_stats(step_times[i].tolist(), args.batch * args.seq_len) | {
            "median_exposed_tp_s": statistics.median(exposed[i, :, 0].tolist()),
            "median_exposed_tp_backward_s": statistics.median(exposed[i, :, 1].tolist()),
            "exposed_tp_s": exposed[i].tolist()}
    r["ratio_step"], r["median_paired_ratio_step"] = bench.ratios(step_times[1], step_times[0])
    for key in ("exposed_tp", "exposed_tp_backward"):
        r[f"ratio_{key}"] = r["overlapped"][f"median_{key}_s"] / r["blocking"][f"median_{key}_s"]
    return r


def overlap_report(r: dict, args) -> None:
    print(f"model {r['model']} ({r['params'] / 1e6:.2f}M params, float32) | tp {r['tp']} (dp 1), {r['backend']}, "
          f"{r['device']}, {r['threads_per_rank']} thread(s)/rank | batch {args.batch} x {args.seq_len} tokens | "
          f"{args.steps} measured steps each after {args.warmup} warm-up")
    print(bench.table_header(22) + f"{'exposed tp':>13}{'of it backward':>17}")
    for side in ("blocking", "overlapped"):
        s = r[side]
        print(bench.table_row(f"minipar TP, {side}", s, 22) + f"{s['median_exposed_tp_s'] * 1e3:>10.1f} ms"
              f"{s['median_exposed_tp_backward_s'] * 1e3:>14.1f} ms")
    print(f"ratio overlapped / blocking: step {r['ratio_step']:.3f}x (median of step-by-step ratios "
          f"{r['median_paired_ratio_step']:.3f}x), exposed tp {r['ratio_exposed_tp']:.3f}x, in backward "
          f"{r['ratio_exposed_tp_backward']:.3f}x")
    sent = sum(e["sent"] for e in r["ledger_per_step"].values()) / 2**20
    print(f"the same computation: losses of all {args.warmup + args.steps} steps bitwise equal: "
          f"{'yes' if r['losses_bitwise_equal'] else 'NO'}; the same ledger every step: "
          f"{'yes' if r['ledgers_equal'] else 'NO'} ({sent:.2f} MiB sent; {calls(r['ledger_per_step'])})")
    bench.write_json(args.json, r)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = bench.world_size()
    cfg = TrainConfig(tp=world, model=args.model, seed=args.seed, seq_len=args.seq_len, global_batch=args.batch,
                      micro_batch=args.batch)
    if not bench.valid("bench_tp", lambda: cfg.validate(world), lambda: check_layout(args, world)):
        return 2
    device, mesh = bench.start(tp=world)
    model_cfg = get_config(cfg.model)
    if args.overlap:
        results = overlap_summary(overlap_run(args, cfg, model_cfg, mesh, device), args, mesh, device)
        if dist.get_rank() == 0:
            overlap_report(results, args)
        bench.finish(mesh)
        return 0
    ours, theirs, steps = build_sides(cfg, model_cfg, mesh, device)
    first = bench.random_batch(0, args.seed, args.batch, args.seq_len, model_cfg.vocab_size, device)
    grad_diff = gradient_difference(ours, theirs, *first, mesh.groups().tp)
    run = run_steps(steps, args, model_cfg.vocab_size, mesh, device)
    results = summarise(run, ours, theirs, grad_diff, args, mesh, device)
    if dist.get_rank() == 0:
        report(results, args)
    bench.finish(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
