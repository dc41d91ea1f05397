"""Benchmark: minipar's pipeline executor against torch.distributed.pipelining, GPipe and 1F1B.

    torchrun --standalone --nproc-per-node 2 scripts/bench_pp.py     # pp = 2, 1-2 minutes on 2 CPU cores
    torchrun --standalone --nproc-per-node 4 scripts/bench_pp.py     # pp = 4: one layer per stage ("small")
    torchrun --standalone --nproc-per-node 4 scripts/bench_pp.py --model 125m --json pp.json   # a GPU node

One launch, every rank one pipeline stage (pp = world, dp = tp = 1). For each schedule, GPipe and
1F1B, every rank builds its stage twice, from the same weights (Llama(config, seed, layer_ids=...)):

    (a) minipar  Pipeline(mesh.pp_group, schedule, n_layers) runs the stage Llama, wrapped in
                 DataParallel (a no-op at dp = 1); step: minipar.train.train_step(..., pipeline=...)
    (b) PyTorch  PipelineStage(StageModule(stage Llama)) run by ScheduleGPipe / Schedule1F1B;
                 step: `torch_train_step` below: schedule.step, then train_step's own tail

We time whole optimizer steps, not only the forward and backward: that is what a user waits for,
and train_step is the code minipar trains with. The tail after the pipeline is the same code on
both sides (minipar's clip_grad_norm, whose one all-reduce over pp sums the stages' squared
norms, then AdamW from build_optimizer and zero_grad), so the two steps differ only in the
pipeline that runs the micro-batches.

The two sides compute the same loss. minipar's last stage computes it inside forward_stage
(targets given) and divides each micro-batch's mean cross-entropy by m before backward. For
torch the stage returns logits and the schedule's loss_fn computes F.cross_entropy / m. Its
schedules backprop each loss_fn value as it is, and with the default scale_grads=True they then
divide every gradient by m after the last backward. We pass scale_grads=False and divide the loss
instead, as minipar does: the same gradients and no extra pass over them. The cross-entropy
itself differs (minipar's vocab_parallel_cross_entropy, written to work on vocabulary shards,
against torch's fused F.cross_entropy); `--torch-loss minipar` gives torch's loss_fn minipar's
function, and then the two sides do the very same arithmetic and only the pipelines differ.
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
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from minipar.collectives import Group, all_reduce
from minipar.config import ConfigError, TrainConfig
from minipar.data_parallel import DataParallel
from minipar.mesh import Mesh
from minipar.model import CONFIGS, Llama, get_config
from minipar.pipeline import Pipeline, stage_layers
from minipar.pipeline_schedules import bubble_formula
from minipar.tensor_parallel import vocab_parallel_cross_entropy
from minipar.train import build_optimizer, clip_grad_norm, start_distributed, train_step

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="named model size")
    p.add_argument("--steps", type=int, default=40, help="measured optimizer steps, each of the four")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured optimizer steps first, each of the four")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--micro-batches", type=int, default=8, help="m: micro-batches per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--torch-loss", default="torch", choices=["torch", "minipar"],
                   help="torch side's cross-entropy: F.cross_entropy, or minipar's (then only the pipelines differ)")
    p.add_argument("--seed", type=int, default=0, help="model weights and token batches")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p.parse_args(argv)


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


def batch(step: int, args, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and targets of step `step`: random, the same on every rank and for both sides."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]  # [b, s] each: targets are the inputs shifted by one


# ----------------------------------------------------------------------------------------------
# The torch.distributed.pipelining side
# ----------------------------------------------------------------------------------------------


class StageModule(nn.Module):
    """One stage for PipelineStage: minipar's stage Llama, returning the activations for the next
    stage, or on the last stage the logits (the schedule's loss_fn computes the loss)."""

    def __init__(self, llama: Llama, pipeline: Pipeline):
        super().__init__()
        self.llama = llama
        self.layer_ids, self.first, self.last = pipeline.my_layers(), pipeline.holds_first(), pipeline.holds_last()

    def forward(self, x):  # tokens [b, s] or activations [b, s, d] -> [b, s, d], or logits [b, s, V]
        return self.llama.forward_stage(x, self.layer_ids, first=self.first, last=self.last)


def mean_over_micro_batches(m: int, cross_entropy: str, vocab_size: int):
    """loss_fn for torch's schedules: each micro-batch's mean cross-entropy / m, as minipar's.

    cross_entropy "torch" is F.cross_entropy; "minipar" is the loss minipar's last stage computes
    (vocab_parallel_cross_entropy on a tp group of one), so that only the pipelines differ."""
    solo = Group.solo("tp")

    def loss_fn(logits, targets):  # [b, s, V], [b, s]
        if cross_entropy == "minipar":
            return vocab_parallel_cross_entropy(logits, targets, solo, vocab_size) / m
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / m
    return loss_fn


def torch_train_step(schedule, stage: PipelineStage, optimizer, x, y, grad_clip: float,
                     pp_group: Group) -> tuple[float, float]:
    """torch's pipeline, then train_step's tail. Returns (loss on the last stage, else 0, grad norm)."""
    losses = []
    inputs = (x,) if stage.is_first else ()
    schedule.step(*inputs, target=y if stage.is_last else None, losses=losses, return_outputs=False)
    grad_norm = clip_grad_norm(stage.submod.parameters(), grad_clip, Group.solo("tp"), pp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(sum(loss.detach() for loss in losses)) if losses else 0.0, grad_norm


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def build_pair(name: str, mesh: Mesh, torch_pg, model_cfg, cfg: TrainConfig, m: int, cross_entropy: str,
               device) -> dict:
    """This rank's stage twice, minipar's and torch's, for schedule `name`, with their step functions."""
    pipeline = Pipeline(mesh.pp_group, name, model_cfg.n_layers)

    def stage_llama() -> Llama:
        return Llama(model_cfg, seed=cfg.seed, layer_ids=pipeline.my_layers(), embed=pipeline.holds_first(),
                     head=pipeline.holds_last()).to(device)

    ours = DataParallel(stage_llama(), mesh.dp_group)
    stage = PipelineStage(StageModule(stage_llama(), pipeline), pipeline.group.rank, pipeline.n_stages, device,
                          group=torch_pg)
    schedule = SCHEDULES[name](stage, m, loss_fn=mean_over_micro_batches(m, cross_entropy, model_cfg.vocab_size),
                                 scale_grads=False)
    opt_ours, opt_theirs = build_optimizer(ours.module, cfg), build_optimizer(stage.submod, cfg)
    return {
        "pipeline": pipeline, "ours": ours, "stage": stage, "schedule": schedule,
        "minipar": lambda x, y: train_step(ours, opt_ours, list(zip(x.chunk(m), y.chunk(m))), cfg.grad_clip,
                                           pipeline=pipeline),
        "torch": lambda x, y: torch_train_step(schedule, stage, opt_theirs, x, y, cfg.grad_clip, mesh.pp_group),
    }


def first_batch_difference(pair: dict, x, y, m: int) -> tuple[float, float, float, float]:
    """One forward and backward of each side on (x, y), no update: (minipar's loss, torch's loss
    (0 off the last stage), max |grad minipar - grad torch| and max |grad torch| over this stage's
    parameters). Both sides' gradients are then dropped."""
    ours, stage = pair["ours"], pair["stage"]
    loss_ours = float(pair["pipeline"].run(ours.module, list(zip(x.chunk(m), y.chunk(m)))))
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


def barrier(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def timed(step_fn, x, y, device) -> tuple[float, float]:
    """Run one optimizer step from a barrier: (seconds on this rank, loss)."""
    barrier(device)
    t0 = time.perf_counter()
    loss, _ = step_fn(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, loss


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    m = args.micro_batches
    cfg = TrainConfig(pp=world, model=args.model, seed=args.seed, seq_len=args.seq_len, global_batch=args.batch,
                      micro_batch=args.batch // m)
    try:
        check_layout(args, world)
        cfg.validate(world)
    except ValueError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"bench_pp: error: {e}", file=sys.stderr)
        return 2

    # Ranks on one machine share its cores: one rank's threads beyond its share only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    device = start_distributed()
    rank = dist.get_rank()
    mesh = Mesh.build(pp=world)
    torch_pg = dist.new_group(mesh.pp_group.ranks)  # torch's messages never share minipar's group
    model_cfg = get_config(cfg.model)
    pairs = {name: build_pair(name, mesh, torch_pg, model_cfg, cfg, m, args.torch_loss, device) for name in SCHEDULES}
    sides = [(name, impl) for name in SCHEDULES for impl in ("minipar", "torch")]

    # The same computation? Loss and gradients of the first batch, before any update.
    check = torch.tensor([first_batch_difference(pairs[name], *batch(0, args, model_cfg.vocab_size, device), m)
                          for name in SCHEDULES], dtype=torch.float64, device=device)  # [schedules, 4]
    losses_check, grads_check = check[:, :2].clone(), check[:, 2:].clone()
    all_reduce(losses_check, mesh.pp_group)  # only the last stage's are not 0
    all_reduce(grads_check, mesh.pp_group, op="max")

    times = {side: [] for side in sides}
    losses = {side: [] for side in sides}
    sent, bubbles = [], {name: [] for name in SCHEDULES}
    for step in range(args.warmup + args.steps):
        x, y = batch(step, args, model_cfg.vocab_size, device)
        for name, impl in sides if step % 2 == 0 else sides[::-1]:
            mesh.ledger.reset()
            dt, loss = timed(pairs[name][impl], x, y, device)
            losses[name, impl].append(loss)
            if step >= args.warmup:
                times[name, impl].append(dt)
                if impl == "minipar":
                    bubbles[name].append(pairs[name]["pipeline"].bubble)
                    sent.append(mesh.ledger.total_sent())

    # A step takes as long as its slowest rank; losses live on the last stage.
    step_times = torch.tensor([times[s] for s in sides], dtype=torch.float64, device=device)
    all_reduce(step_times, mesh.pp_group, op="max")
    step_times = step_times.cpu()
    step_losses = torch.tensor([losses[s] for s in sides], dtype=torch.float64, device=device)
    all_reduce(step_losses, mesh.pp_group)
    bubble = torch.tensor([statistics.median(bubbles[name]) for name in SCHEDULES], dtype=torch.float64,
                          device=device)
    all_reduce(bubble, mesh.pp_group)
    bubble = (bubble / world).tolist()  # minipar's measured idle fraction, the mean over ranks
    busiest = torch.tensor([statistics.median(sent)], dtype=torch.float64, device=device)
    all_reduce(busiest, mesh.pp_group, op="max")
    with torch.no_grad():
        param_diff = torch.tensor([max((p - q).abs().max().item() for p, q in zip(
            pairs[name]["ours"].module.parameters(), pairs[name]["stage"].submod.llama.parameters(), strict=True))
            for name in SCHEDULES], dtype=torch.float64, device=device)
    all_reduce(param_diff, mesh.pp_group, op="max")

    tokens_per_step = args.batch * args.seq_len
    psi = model_cfg.num_params()
    results = {
        "model": cfg.model, "params": psi, "pp": world, "layers": stage_layers(model_cfg.n_layers, world),
        "backend": dist.get_backend(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(), "steps": args.steps,
        "warmup": args.warmup, "batch": args.batch, "micro_batches": m, "seq_len": args.seq_len,
        "torch_loss": args.torch_loss,
        "minipar_bytes_sent_per_step_busiest_rank": busiest.item(), "bubble_formula": bubble_formula(world, m),
    }
    for i, (name, impl) in enumerate(sides):
        t = step_times[i].tolist()
        results[f"{name}_{impl}"] = {"median_step_s": statistics.median(t), "min_step_s": min(t),
                                     "max_step_s": max(t), "tokens_per_s": tokens_per_step / statistics.median(t),
                                     "step_times_s": t}
    for j, name in enumerate(SCHEDULES):
        ours, theirs = step_times[2 * j], step_times[2 * j + 1]
        loss_diff = (step_losses[2 * j] - step_losses[2 * j + 1]).abs().max().item()
        results[name] = {
            "ratio_minipar_over_torch": statistics.median(ours.tolist()) / statistics.median(theirs.tolist()),
            # The same ratio step by step (the two steps of a pair ran back to back on the same
            # batch): less sensitive to slow drifts in the machine's load.
            "median_paired_ratio": statistics.median((ours / theirs).tolist()),
            "minipar_bubble": bubble[j],
            "first_loss": {"minipar": losses_check[j, 0].item(), "torch": losses_check[j, 1].item()},
            "first_grad_max_abs_diff": grads_check[j, 0].item(), "first_grad_max_abs": grads_check[j, 1].item(),
            "max_step_loss_abs_diff": loss_diff, "max_abs_param_diff": param_diff[j].item(),
        }

    if rank == 0:
        print(f"model {cfg.model} ({psi / 1e6:.2f}M params, float32) | pp {world}, layers per stage "
              f"{results['layers']} | {results['backend']}, {results['device']}, {results['threads_per_rank']} "
              f"thread(s)/rank | batch {args.batch} x {args.seq_len} tokens in {m} micro-batches of "
              f"{args.batch // m} | {args.steps} measured steps each after {args.warmup} warm-up | torch loss_fn: "
              f"{'F.cross_entropy' if args.torch_loss == 'torch' else 'minipar vocab_parallel_cross_entropy'}")
        print(f"{'':<28}{'median step':>13}{'min':>11}{'max':>11}{'tokens/s':>11}")
        labels = {"minipar": "minipar Pipeline", "torch": "torch Schedule"}
        for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
            for impl in ("minipar", "torch"):
                r = results[f"{name}_{impl}"]
                print(f"{label + ' ' + labels[impl] + (label if impl == 'torch' else ''):<28}"
                      f"{r['median_step_s'] * 1e3:>10.1f} ms{r['min_step_s'] * 1e3:>8.1f} ms"
                      f"{r['max_step_s'] * 1e3:>8.1f} ms{r['tokens_per_s']:>11,.0f}")
            r = results[name]
            print(f"{label + ' ratio minipar / torch':<28}{r['ratio_minipar_over_torch']:>10.3f}x   (goal: <= 1.0x); "
                  f"median of step-by-step ratios {r['median_paired_ratio']:.3f}x")
        print(f"minipar measured bubble (mean over ranks): GPipe {results['gpipe']['minipar_bubble']:.0%}, "
              f"1F1B {results['1f1b']['minipar_bubble']:.0%}; formula (p-1)/(m+p-1) = {bubble_formula(world, m):.0%}")
        print(f"minipar sent per step (ledger), busiest rank: {busiest.item() / 2**20:.2f} MiB")
        for name, label in (("gpipe", "GPipe"), ("1f1b", "1F1B")):
            r = results[name]
            print(f"{label}: first batch, no update: loss minipar {r['first_loss']['minipar']:.7f}, torch "
                  f"{r['first_loss']['torch']:.7f}; max |grad minipar - grad torch| = "
                  f"{r['first_grad_max_abs_diff']:.3g} (max |grad| {r['first_grad_max_abs']:.3g}); over "
                  f"{args.warmup + args.steps} steps max |loss difference| = {r['max_step_loss_abs_diff']:.3g}, "
                  f"then max |param difference| = {r['max_abs_param_diff']:.3g}")
        worst = max(results[n]["first_grad_max_abs_diff"] / results[n]["first_grad_max_abs"] for n in SCHEDULES)
        print(f"same computation: {'yes' if worst < 1e-5 else 'NO, the timings compare different work'} (first-batch "
              f"gradients agree to {worst:.2g} of the largest; float32 rounding is ~1e-7)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
            print(f"wrote {args.json}")
    mesh.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
