"""Benchmark: minipar's hand-written tensor parallelism against PyTorch's DTensor tensor parallelism.

    torchrun --standalone --nproc-per-node 2 scripts/bench_tp.py                  # about 2 minutes on 2 CPU cores
    torchrun --standalone --nproc-per-node 4 scripts/bench_tp.py --model 125m --json tp.json   # 4 GPUs (NCCL)

One launch trains two copies of the same model side by side, every rank a tp rank (tp = world, dp = 1):

    (a) minipar   Llama(config, seed, tp_group=mesh.tp_group): each rank builds only its shards;
                  DataParallel(model, mesh.dp_group) (a no-op at dp = 1); step: minipar.train.train_step
    (b) PyTorch   the single-device Llama(config, seed), its layers swapped for nn.Linear / nn.Embedding
                  holding the same weights, then parallelize_module(model, device_mesh, plan) below;
                  step: `dtensor_train_step`, written with torch's own tools

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
MLP and Block code runs unchanged on the DTensor side; only the attention's local head counts are
set to n_heads / tp after parallelising (as torchtitan does), because the model computed them for
one device. parallelize_module accepts only nn.Linear and nn.Embedding (it checks the class), hence
the swap: minipar's single-device layers are the same F.linear / F.embedding on the same weights.

Both sides start from the same weights (a shard of minipar's is the slice of the single-device
tensor), see the same random batches, and step with the same AdamW (build_optimizer on one
TrainConfig: lr 3e-3, weight decay 0.1 on matrices) and gradient clipping at 1.0. PyTorch's
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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

from minipar.collectives import all_reduce, ring_bytes_sent
from minipar.config import ConfigError, TrainConfig
from minipar.data_parallel import DataParallel
from minipar.mesh import Mesh
from minipar.model import CONFIGS, Attention, Block, Llama, get_config
from minipar.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, unshard
from minipar.train import build_optimizer, start_distributed, train_step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="small", choices=list(CONFIGS), help="named model size")
    p.add_argument("--steps", type=int, default=100, help="measured optimizer steps, each of the two")
    p.add_argument("--warmup", type=int, default=5,
                   help="unmeasured optimizer steps first, each of the two (the first counts DTensor's collectives)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (every tp rank sees all of them)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="model weights and token batches")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p.parse_args(argv)


def check_layout(args, world: int) -> None:
    """Refuse, with the reason, what one of the two sides cannot do."""
    if args.steps < 1 or args.warmup < 1:
        raise ConfigError("--steps and --warmup must be at least 1 (the first warm-up step counts collectives)")
    if args.batch < 1 or args.seq_len < 1:
        raise ConfigError("--batch and --seq-len must be at least 1")
    m = CONFIGS[args.model]
    if args.seq_len > m.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the model's {m.max_seq_len}")
    # ColwiseParallel cuts wk and wv into tp equal row blocks: with fewer kv heads than ranks a
    # block would be part of a head. (minipar replicates them then; DTensor has no such style.)
    for name, size in (("attention heads", m.n_heads), ("kv heads", m.n_kv_heads), ("hidden size", m.dim),
                       ("MLP size", m.ffn_dim), ("vocabulary", m.vocab_size)):
        if size % world:
            raise ConfigError(f"tp {world} does not divide the model's {size} {name} (--model {args.model}): "
                              f"launch with a --nproc-per-node that divides it")


def batch(step: int, args, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and targets of step `step`: random, the same on every rank and for both sides."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]  # [b, s] each: targets are the inputs shifted by one


# ----------------------------------------------------------------------------------------------
# The DTensor side
# ----------------------------------------------------------------------------------------------


def to_torch_layers(module: nn.Module) -> nn.Module:
    """Replace minipar's single-device layers by nn.Linear / nn.Embedding holding the same Parameters.

    parallelize_module's styles only accept those two classes. With a tp group of one, minipar's
    ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding compute exactly F.linear and
    F.embedding, so the model computes the same function before and after.
    """
    for name, child in module.named_children():
        if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
            assert child.group.size == 1 and child.bias is None
            torch_layer = nn.Linear(child.weight.shape[1], child.weight.shape[0], bias=False,
                                    device=child.weight.device)
        elif isinstance(child, VocabParallelEmbedding):
            assert child.group.size == 1
            torch_layer = nn.Embedding(*child.weight.shape, device=child.weight.device)
        else:
            to_torch_layers(child)
            continue
        torch_layer.weight = child.weight
        setattr(module, name, torch_layer)
    return module


def tp_plan(model: nn.Module) -> dict:
    """torchtitan's Llama plan without sequence parallelism (see the table in the docstring)."""
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
    }
    for layer in (name for name, m in model.named_modules() if isinstance(m, Block)):  # "layers.0", ...
        plan |= {
            # attn(x, cos, sin), mlp(x): x becomes one replicated DTensor that the linears share.
            f"{layer}.attn": PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
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
    model = to_torch_layers(Llama(config, seed=seed).to(device))
    parallelize_module(model, device_mesh, tp_plan(model))
    tp = device_mesh.size()
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        attn.local_heads = config.n_heads // tp  # the attention reshapes by these: 1/tp of the heads here
        attn.local_kv_heads = config.n_kv_heads // tp
    return model


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


def dtensor_train_step(model: nn.Module, optimizer, x, y, grad_clip: float) -> tuple[float, float]:
    """One optimizer step, torch's way. Returns (loss, gradient norm), like minipar's train_step."""
    with loss_parallel():  # cross_entropy on vocabulary-sharded logits; its backward must be inside too
        logits = model(x)  # DTensor [b, s, V], Shard(-1): each rank holds V/tp columns
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
    grad_norm = clip_grad_norm_mixed(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach().full_tensor()), float(grad_norm)


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
    cfg = TrainConfig(tp=world, model=args.model, seed=args.seed, seq_len=args.seq_len, global_batch=args.batch,
                      micro_batch=args.batch)
    try:
        cfg.validate(world)
        check_layout(args, world)
    except ValueError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"bench_tp: error: {e}", file=sys.stderr)
        return 2

    # Ranks on one machine share its cores: one rank's threads beyond its share only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    device = start_distributed()
    rank = dist.get_rank()
    mesh = Mesh.build(tp=world)
    device_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))

    model_cfg = get_config(cfg.model)
    ours = DataParallel(Llama(model_cfg, seed=cfg.seed, tp_group=mesh.tp_group).to(device), mesh.dp_group)
    theirs = build_dtensor_model(model_cfg, cfg.seed, device, device_mesh)
    opt_ours, opt_theirs = build_optimizer(ours.module, cfg), build_optimizer(theirs, cfg)
    sides = {
        "minipar": lambda x, y: train_step(ours, opt_ours, [(x, y)], cfg.grad_clip, tp_group=mesh.tp_group),
        "dtensor": lambda x, y: dtensor_train_step(theirs, opt_theirs, x, y, cfg.grad_clip),
    }

    grad_diff = gradient_difference(ours, theirs, *batch(0, args, model_cfg.vocab_size, device), mesh.tp_group)
    times = {name: [] for name in sides}
    losses = {name: [] for name in sides}
    sent, snapshot, counter = [], {}, CollectiveCounter(world)
    for step in range(args.warmup + args.steps):
        x, y = batch(step, args, model_cfg.vocab_size, device)
        order = ("minipar", "dtensor") if step % 2 == 0 else ("dtensor", "minipar")
        for name in order:
            mesh.ledger.reset()
            # DTensor's collectives are counted once, in the first (unmeasured) step.
            with counter if (name == "dtensor" and step == 0) else nullcontext():
                dt, loss = timed(sides[name], x, y, device)
            losses[name].append(loss)
            if name == "minipar":
                sent.append(mesh.ledger.total_sent())
                snapshot = mesh.ledger.snapshot()
            if step >= args.warmup:
                times[name].append(dt)

    # A step takes as long as its slowest rank.
    step_times = torch.tensor([times["minipar"], times["dtensor"]], dtype=torch.float64, device=device)
    all_reduce(step_times, mesh.tp_group, op="max")
    step_times = step_times.cpu()

    # The same computation? Every parameter, gathered whole on every rank, compared by name.
    with torch.no_grad():
        full_theirs = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in theirs.named_parameters()}
        param_diff = max((unshard(p.detach(), p, mesh.tp_group) - full_theirs[n]).abs().max().item()
                         for n, p in ours.module.named_parameters())
    loss_rel = [abs(a - b) / abs(b) for a, b in zip(losses["minipar"], losses["dtensor"], strict=True)]

    tokens_per_step = args.batch * args.seq_len
    psi = model_cfg.num_params()
    dtensor_comm = dict(sorted(counter.entries.items()))
    results = {
        "model": cfg.model, "params": psi, "tp": world, "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(),
        "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq_len": args.seq_len,
        "minipar_bytes_sent_per_step": statistics.median(sent), "minipar_ledger": snapshot,
        "dtensor_bytes_sent_per_step": sum(e["sent"] for e in dtensor_comm.values()), "dtensor_comm": dtensor_comm,
        "first_loss": {"minipar": losses["minipar"][0], "dtensor": losses["dtensor"][0]},
        "first_loss_rel_diff": loss_rel[0], "max_loss_rel_diff_first_10": max(loss_rel[:10]),
        "max_loss_rel_diff": max(loss_rel),
        "first_grad_max_rel_diff": grad_diff, "max_abs_param_diff": param_diff,
    }
    for i, name in enumerate(sides):
        t = step_times[i].tolist()
        results[name] = {"median_step_s": statistics.median(t), "min_step_s": min(t), "max_step_s": max(t),
                         "tokens_per_s": tokens_per_step / statistics.median(t), "step_times_s": t}
    results["ratio_minipar_over_dtensor"] = results["minipar"]["median_step_s"] / results["dtensor"]["median_step_s"]
    # The same ratio step by step (the two steps of a pair ran back to back on the same batch):
    # less sensitive to slow drifts in the machine's load.
    results["median_paired_ratio"] = statistics.median((step_times[0] / step_times[1]).tolist())

    if rank == 0:
        print(f"model {cfg.model} ({psi / 1e6:.2f}M params, float32) | tp {world} (dp 1), {results['backend']}, "
              f"{results['device']}, {results['threads_per_rank']} thread(s)/rank | batch {args.batch} x "
              f"{args.seq_len} tokens | {args.steps} measured steps each after {args.warmup} warm-up")
        print(f"{'':<22}{'median step':>13}{'min':>11}{'max':>11}{'tokens/s':>11}")
        for name, label in (("minipar", "minipar TP"), ("dtensor", "torch DTensor TP")):
            r = results[name]
            print(f"{label:<22}{r['median_step_s'] * 1e3:>10.1f} ms{r['min_step_s'] * 1e3:>8.1f} ms"
                  f"{r['max_step_s'] * 1e3:>8.1f} ms{r['tokens_per_s']:>11,.0f}")
        print(f"ratio minipar / DTensor {results['ratio_minipar_over_dtensor']:>8.3f}x   (goal: <= 1.0x); "
              f"median of step-by-step ratios {results['median_paired_ratio']:.3f}x")

        def calls(entries: dict) -> str:
            return ", ".join(f"{k} {e['calls']} calls, payload {e['bytes'] / 2**20:.2f} MiB"
                             for k, e in entries.items())

        print("collectives per step, one rank (sent: by the ring formula of minipar's ledger)")
        for label, key, entries in (("minipar (ledger)", "minipar", snapshot),
                                    ("DTensor (counted)", "dtensor", dtensor_comm)):
            print(f"  {label:<20}{results[key + '_bytes_sent_per_step'] / 2**20:>6.2f} MiB sent; {calls(entries)}")
        print(f"gradients of the first batch: max |minipar - DTensor| / max |DTensor|, worst parameter: "
              f"{grad_diff:.2g}")
        print(f"loss, relative difference: step 1 {loss_rel[0]:.2g} (minipar {losses['minipar'][0]:.7f}, DTensor "
              f"{losses['dtensor'][0]:.7f}), largest in steps 1-10 {max(loss_rel[:10]):.2g}, "
              f"in all {len(loss_rel)} steps {max(loss_rel):.2g}")
        print(f"after {args.warmup + args.steps} steps: max |param minipar - param DTensor| = {param_diff:.3g} "
              f"(float32 drift, for scale: see the docstring)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
            print(f"wrote {args.json}")
    mesh.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
