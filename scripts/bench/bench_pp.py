"""Benchmark: minipar's pipeline executor against torch.distributed.pipelining, GPipe and 1F1B.

    torchrun --standalone --nproc-per-node 2 scripts/bench/bench_pp.py     # pp = 2, 1-2 minutes on 2 CPU cores
    torchrun --standalone --nproc-per-node 4 scripts/bench/bench_pp.py     # pp = 4: one layer per stage ("small")
    torchrun --standalone --nproc-per-node 4 scripts/bench/bench_pp.py --model 125m --json pp.json   # a GPU node

One launch, every rank one pipeline stage (pp = world, dp = tp = 1). For each schedule, GPipe and
1F1B, every rank builds its stage twice, from the same weights (parallelize(Llama(config, seed),
stage=...): the plain Llama(config, seed) keeping only this stage's parts):

    (a) minipar  Pipeline(mesh.groups().pp, schedule, n_layers, grad_group=...) runs the stage Llama, wrapped in
                 DataParallel holding its AdamW (no traffic at dp = 1);
                 step: minipar.run.train.train_step(..., pipeline=...)
    (b) PyTorch  PipelineStage(StageModule(stage Llama)) run by ScheduleGPipe / Schedule1F1B;
                 step: `pipelining_train_step`: schedule.step, then train_step's own tail
                 (both in bench_common, shared with bench_gpu.py)

We time whole optimizer steps, not only the forward and backward: that is what a user waits for,
and train_step is the code minipar trains with. The tail after the pipeline is the same code on
both sides (minipar.data_parallel.clip_grads, whose one all-reduce over pp sums the stages'
squared norms, then AdamW from parallelize.adamw and zero_grad), so the two steps differ only in
the pipeline that runs the micro-batches.

The two sides compute the same loss. minipar's last stage computes it inside forward_stage
(targets given: the stage Llama's loss_fn, at tp = 1 the plain model's cross_entropy, which is
F.cross_entropy) and divides each micro-batch's mean cross-entropy by m before backward. For
torch the stage returns logits and the schedule's loss_fn computes F.cross_entropy / m. Its
schedules backprop each loss_fn value as it is, and with the default scale_grads=True they then
divide every gradient by m after the last backward. We pass scale_grads=False and divide the loss
instead, as minipar does: the same gradients and no extra pass over them. Both cross-entropies
are then torch's fused F.cross_entropy, and the two sides do the very same arithmetic; `--torch-loss
minipar` hands torch's loss_fn the very function minipar's last stage calls (Llama.loss_fn), which
keeps that so whatever the model's loss function is.
The two sides send over separate process groups of the same ranks, so their messages cannot
meet; `step(..., return_outputs=False)` keeps torch from concatenating the logits of every
micro-batch, which minipar never does.

The four models take turns step by step (forward order, then reversed: minipar and torch swap
places at every step) after `--warmup` unmeasured steps each. Each step starts from a barrier, is
timed with time.perf_counter (after torch.cuda.synchronize on GPUs) and lasts as long as its
slowest rank. Rank 0 prints the median step times, the ratio minipar / torch for each schedule
(the goal is <= 1.0x), minipar's measured bubble, and checks that both sides computed the same
thing: the loss and every gradient of one forward and backward on the first batch, before any
update, and the losses of every step. (The parameters after many steps agree less closely when the
cross-entropies differ: AdamW divides by the root of the squared gradient, so in entries whose
gradient is near zero it turns rounding differences into full-size updates.)

Backend: NCCL and cuda:LOCAL_RANK when CUDA is available, else gloo on CPU, with torch threads set
to the cores per rank. Both sides compute in float32.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import bench_common as bench
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from minipar.data_parallel import DataParallel, param_groups
from minipar.mesh import Mesh
from minipar.model import CONFIGS, Llama, get_config
from minipar.parallelize import adamw, parallelize
from minipar.pipeline.executor import Pipeline, stage_layers
from minipar.pipeline.schedules import bubble_formula, build
from minipar.pipeline.timeline import simulate
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.train import train_step

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args(argv=None) -> argparse.Namespace:
    p = bench.command_line(__doc__, "four", steps=40, warmup=3)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro-batches", type=int, default=8, help="m: micro-batches per step")
    p.add_argument("--torch-loss", default="torch", choices=["torch", "minipar"],
                   help="torch side's cross-entropy: F.cross_entropy, or the function minipar's last stage calls")
    return bench.parse(p, argv)


def check_layout(args, world: int) -> None:
    """Refuse, with the reason, what one of the two sides cannot do."""
    if world < 2:
        raise ConfigError("a pipeline needs at least 2 stages: launch with torchrun --nproc-per-node 2 or more")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps must be at least 1 and --warmup at least 0")
    m = args.micro_batches
    if m < world:
        raise ConfigError(f"torch's Schedule1F1B needs at least as many micro-batches as stages: "
                          f"--micro-batches {m} < pp {world}")
    if args.batch % m:
        raise ConfigError(f"--batch {args.batch} is not divisible by --micro-batches {m}")
    if args.seq_len > CONFIGS[args.model].max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the model's {CONFIGS[args.model].max_seq_len}")
    stage_layers(CONFIGS[args.model].n_layers, world)  # raises: more stages than layers


# ----------------------------------------------------------------------------------------------
# The run. torch's side is bench_common's: StageModule wraps this rank's stage Llama for
# PipelineStage, mean_over_micro_batches is the schedules' loss_fn, pipelining_train_step runs the
# schedule, then train_step's own tail.
# ----------------------------------------------------------------------------------------------


def build_pair(name: str, mesh: Mesh, torch_pg, model_cfg, cfg: TrainConfig, m: int, cross_entropy: str,
               device) -> dict:
    """This rank's stage twice, minipar's and torch's, for schedule `name`, with their step functions."""
    # as train.py
    pipeline = Pipeline(mesh.groups().pp, name, model_cfg.n_layers, grad_group=mesh.group("pp", channel="grad"))

    def stage_llama() -> Llama:
        stage = (pipeline.my_layers(), pipeline.holds_first(), pipeline.holds_last())
        return parallelize(Llama(model_cfg, seed=cfg.seed), stage=stage).to(device)

    mine = stage_llama()
    ours = DataParallel(mine, mesh.groups(), optimizer=adamw(param_groups(mine, cfg), cfg.lr))
    stage = PipelineStage(bench.StageModule(stage_llama(), pipeline), pipeline.group.rank, pipeline.n_stages, device,
                          group=torch_pg)
    schedule = SCHEDULES[name](stage, m, loss_fn=bench.mean_over_micro_batches(m, cross_entropy, stage.submod.llama),
                                 scale_grads=False)
    opt_theirs = adamw(param_groups(stage.submod, cfg), cfg.lr)
    return {
        "pipeline": pipeline, "ours": ours, "stage": stage, "schedule": schedule,
        "minipar": lambda x, y: train_step(ours, list(zip(x.chunk(m), y.chunk(m))), cfg.grad_clip,
                                           pipeline=pipeline),
        "torch": lambda x, y: bench.pipelining_train_step(schedule, stage, opt_theirs, x, y, cfg.grad_clip,
                                                          mesh.groups().pp),
    }


def first_batch_difference(pair: dict, x, y, m: int) -> tuple[float, float, float, float]:
    """One forward and backward of each side on (x, y), no update: (minipar's loss, torch's loss
    (0 off the last stage), max |grad minipar - grad torch| and max |grad torch| over this stage's
    parameters). Both sides' gradients are then dropped."""
    ours, stage = pair["ours"], pair["stage"]
    loss_ours = float(pair["pipeline"].run(ours.module, list(zip(x.chunk(m), y.chunk(m))), y.numel()))
    losses = []
    pair["schedule"].step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None, losses=losses,
                          return_outputs=False)
    with torch.no_grad():
        pairs = list(zip(ours.module.parameters(), stage.submod.llama.parameters(), strict=True))
        diff = max((p.grad - q.grad).abs().max().item() for p, q in pairs)
        scale = max(q.grad.abs().max().item() for _, q in pairs)
    ours.module.zero_grad(set_to_none=True)
    stage.submod.zero_grad(set_to_none=True)
    ours.finish_grad_sync()  # a no-op at dp = 1; keeps the wrapper's bookkeeping clean
    return loss_ours, float(sum(loss.detach() for loss in losses)) if losses else 0.0, diff, scale


def first_batch_check(pairs: dict, args, vocab: int, mesh: Mesh, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same computation? Loss and gradients of the first batch, before any update. Per schedule:
    (minipar's loss, torch's), summed over the stages (only the last one's are not 0), and
    (max |grad minipar - grad torch|, max |grad torch|) over all stages."""
    def first_batch() -> tuple:  # a fresh copy for each schedule
        return bench.random_batch(0, args.seed, args.batch, args.seq_len, vocab, device)

    check = [first_batch_difference(pairs[name], *first_batch(), args.micro_batches) for name in SCHEDULES]
    losses = bench.across_ranks([c[:2] for c in check], mesh.groups().pp, device, op="sum")
    grads = bench.across_ranks([c[2:] for c in check], mesh.groups().pp, device)
    return losses, grads


def run_steps(pairs: dict, args, vocab: int, mesh: Mesh, device) -> dict:
    """The four models in turn on the same batches. Returns this rank's measured step times and the
    losses of every step per (schedule, side), and minipar's measured bubble and bytes sent per step."""
    sides = {(name, impl): pairs[name][impl] for name in SCHEDULES for impl in ("minipar", "torch")}
    traffic = {"sent": [], "bubbles": {name: [] for name in SCHEDULES}, "costs": {name: [] for name in SCHEDULES}}

    def note(side: tuple, measured: bool) -> None:  # right after each step: its timeline and ledger
        name, impl = side
        if measured and impl == "minipar":
            traffic["bubbles"][name].append(pairs[name]["pipeline"].bubble)
            traffic["costs"][name].append(pairs[name]["pipeline"].timeline.costs())
            traffic["sent"].append(mesh.ledger.total_sent())

    def batch(step: int) -> tuple:
        return bench.random_batch(step, args.seed, args.batch, args.seq_len, vocab, device)

    times, losses = bench.take_turns(sides, batch, args.warmup, args.steps, device, mesh.ledger, note)
    return {"times": times, "losses": losses} | traffic


def over_stages(run: dict, pairs: dict, mesh: Mesh, device) -> dict:
    """This rank's figures combined over the pipeline's stages: a step takes as long as its slowest
    rank; the losses live on the last stage; the bubble is the mean over ranks."""
    sides, group = list(run["times"]), mesh.groups().pp
    with torch.no_grad():
        param_diff = [max((p - q).abs().max().item() for p, q in zip(
            pairs[name]["ours"].module.parameters(), pairs[name]["stage"].submod.llama.parameters(), strict=True))
            for name in SCHEDULES]
    bubble = bench.across_ranks([statistics.median(run["bubbles"][name]) for name in SCHEDULES], group, device,
                                op="sum")
    return {
        "replayed": [replayed_bubble(name, run["costs"][name], len(pairs[name]["pipeline"].timeline.rows[0]) // 2,
                                     group, device) for name in SCHEDULES],  # m: one F and one B each
        "step_times": bench.across_ranks([run["times"][s] for s in sides], group, device),
        "step_losses": bench.across_ranks([run["losses"][s] for s in sides], group, device, op="sum"),
        "bubble": (bubble / group.size).tolist(),  # minipar's measured idle fraction
        "busiest": bench.across_ranks([statistics.median(run["sent"])], group, device).item(),
        "param_diff": bench.across_ranks(param_diff, group, device),
    }


def replayed_bubble(name: str, costs: list[dict], m: int, group, device) -> float:
    """The schedule simulated with each stage's median measured F and B (timeline.simulate): the
    idle that the stages' unequal costs alone make, as the mean of each rank's own idle fraction
    (pipeline.bubble's measure). What the measured bubble has beyond it is messages and overhead."""
    schedule = build(name, group.size, m)
    table = [[statistics.median(c[kind, k] for c in costs) if (kind, k) in costs[0] else 0.0
              for k in range(group.size)] for kind in "FB"]
    table = bench.across_ranks(table, group, device, op="sum")  # every rank fills in its own stage
    rows = simulate(schedule, {(kind, k): table[i, k].item() for i, kind in enumerate("FB")
                               for k in range(group.size)}).rows
    return statistics.mean(1 - sum(e - s for s, e, _ in row) / (row[-1][1] - row[0][0]) for row in rows)


def summarise(f: dict, check: tuple, args, world: int, device) -> dict:
    """The results, from the figures over all stages `f` and the first-batch check."""
    m = args.micro_batches
    losses_check, grads_check = check
    model_cfg = get_config(args.model)
    results = {
        "model": args.model, "params": model_cfg.num_params(), "pp": world,
        "layers": stage_layers(model_cfg.n_layers, world), **bench.machine(device), "steps": args.steps,
        "warmup": args.warmup, "batch": args.batch, "micro_batches": m, "seq_len": args.seq_len,
        "torch_loss": args.torch_loss,
        "minipar_bytes_sent_per_step_busiest_rank": f["busiest"], "bubble_formula": bubble_formula(world, m),
    }
    sides = [f"{name}_{impl}" for name in SCHEDULES for impl in ("minipar", "torch")]
    for side, t in zip(sides, f["step_times"], strict=True):
        results[side] = bench.step_stats(t.tolist(), args.batch * args.seq_len)
    for j, name in enumerate(SCHEDULES):
        ratio, paired = bench.ratios(f["step_times"][2 * j], f["step_times"][2 * j + 1])
        results[name] = {
            "ratio_minipar_over_torch": ratio, "median_paired_ratio": paired, "minipar_bubble": f["bubble"][j],
            "minipar_bubble_replayed": f["replayed"][j],
            "first_loss": {"minipar": losses_check[j, 0].item(), "torch": losses_check[j, 1].item()},
            "first_grad_max_abs_diff": grads_check[j, 0].item(), "first_grad_max_abs": grads_check[j, 1].item(),
            "max_step_loss_abs_diff": (f["step_losses"][2 * j] - f["step_losses"][2 * j + 1]).abs().max().item(),
            "max_abs_param_diff": f["param_diff"][j].item(),
        }
    return results


def report(r: dict, args) -> None:
    world, m = r["pp"], args.micro_batches
    print(f"model {r['model']} ({r['params'] / 1e6:.2f}M params, float32) | pp {world}, layers per stage "
          f"{r['layers']} | {r['backend']}, {r['device']}, {r['threads_per_rank']} "
          f"thread(s)/rank | batch {args.batch} x {args.seq_len} tokens in {m} micro-batches of "
          f"{args.batch // m} | {args.steps} measured steps each after {args.warmup} warm-up | torch loss_fn: "
          f"{'F.cross_entropy' if args.torch_loss == 'torch' else 'minipar Llama.loss_fn'}")
    print(bench.table_header(28))
    labels = {"minipar": "minipar Pipeline", "torch": "torch Schedule"}
    for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
        for impl in ("minipar", "torch"):
            print(bench.table_row(label + " " + labels[impl] + (label if impl == "torch" else ""),
                                  r[f"{name}_{impl}"], 28))
        print(bench.ratio_line(label + " ratio minipar / torch", r[name]["ratio_minipar_over_torch"],
                               r[name]["median_paired_ratio"], 28))
    print(f"minipar measured bubble (mean over ranks): GPipe {r['gpipe']['minipar_bubble']:.0%}, "
          f"1F1B {r['1f1b']['minipar_bubble']:.0%}; formula (p-1)/(m+p-1) = {bubble_formula(world, m):.0%}; "
          f"simulated with each stage's measured F and B: GPipe {r['gpipe']['minipar_bubble_replayed']:.0%}, "
          f"1F1B {r['1f1b']['minipar_bubble_replayed']:.0%}")
    print(f"minipar sent per step (ledger), busiest rank: "
          f"{r['minipar_bytes_sent_per_step_busiest_rank'] / 2**20:.2f} MiB")
    for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
        s = r[name]
        print(f"{label}: first batch, no update: loss minipar {s['first_loss']['minipar']:.7f}, torch "
              f"{s['first_loss']['torch']:.7f}; max |grad minipar - grad torch| = "
              f"{s['first_grad_max_abs_diff']:.3g} (max |grad| {s['first_grad_max_abs']:.3g}); over "
              f"{args.warmup + args.steps} steps max |loss difference| = {s['max_step_loss_abs_diff']:.3g}, "
              f"then max |param difference| = {s['max_abs_param_diff']:.3g}")
    worst = max(r[n]["first_grad_max_abs_diff"] / r[n]["first_grad_max_abs"] for n in SCHEDULES)
    print(f"same computation: {'yes' if worst < 1e-5 else 'NO, the timings compare different work'} (first-batch "
          f"gradients agree to {worst:.2g} of the largest; float32 rounding is ~1e-7)")
    bench.write_json(args.json, r)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = bench.world_size()
    m = args.micro_batches
    cfg = TrainConfig(pp=world, model=args.model, seed=args.seed, seq_len=args.seq_len, global_batch=args.batch,
                      micro_batch=args.batch // m)
    if not bench.valid("bench_pp", lambda: check_layout(args, world), lambda: cfg.validate(world)):
        return 2
    device, mesh = bench.start(pp=world)
    torch_pg = dist.new_group(mesh.groups().pp.ranks)  # torch's messages never share minipar's group
    model_cfg = get_config(cfg.model)
    pairs = {name: build_pair(name, mesh, torch_pg, model_cfg, cfg, m, args.torch_loss, device) for name in SCHEDULES}
    check = first_batch_check(pairs, args, model_cfg.vocab_size, mesh, device)
    run = run_steps(pairs, args, model_cfg.vocab_size, mesh, device)
    results = summarise(over_stages(run, pairs, mesh, device), check, args, world, device)
    if dist.get_rank() == 0:
        report(results, args)
    bench.finish(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
