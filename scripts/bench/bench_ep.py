"""Benchmark: expert parallelism against what a user would do instead: replicate the experts.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/bench/bench_ep.py      # about a minute on 2 CPU cores
    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/bench/bench_ep.py --json ep.json
    torchrun --nproc-per-node 8 scripts/bench/bench_ep.py --seq-len 1024 --json ep.json # a GPU node (NCCL; not run yet)

PyTorch has no expert-parallel layer of its own (torchtitan builds one from DTensor and its own
all-to-all). Without one, a user trains a mixture-of-experts model like any other: every rank
holds every expert and DistributedDataParallel all-reduces every gradient. Or they train a dense
model that costs the same per token. One launch trains four models side by side, on every rank:

    minipar ep        --model (small-moe) at dp = N, ep = N (edp 1): each rank holds E/N experts,
                      tokens reach them and come back by all-to-all (minipar/expert_parallel.py)
    minipar ep=1      the same model, experts replicated, minipar's DataParallel
    torch DDP ep=1    the same model, experts replicated, DistributedDataParallel
    torch DDP dense   a dense Llama of the same shape whose MLP is (top_k + shared) x expert_ffn_dim
                      wide: the same active parameters, so about the same FLOPs per token

All start from Llama(config, seed) and step with the same AdamW (parallelize.adamw on the
param_groups of one TrainConfig) and gradient clipping, on bench_common's random batches, through minipar's
train_step (DDP behind a small adapter, as in bench_dp.py). The three MoE sides train one model
(dropless), so their losses must agree: to float32 rounding, amplified where rounding flips a
token's top-k choice (run with --float64 to see them agree to 1e-10 or so). They
take turns step by step (the order reversed every step) after `--warmup` unmeasured steps; a
step starts from a barrier and lasts as long as its slowest rank.

Per rank it reports: parameter bytes (of which experts), AdamW state bytes, bytes sent per step
(minipar: its ledger, by group; DDP: 2 (N-1)/N x its gradient bytes, the ring all-reduce that
the ledger would count), the expert load imbalance the ep side saw (busiest expert / mean), and
the ratio of step times ep / each other side. Results and their reading: docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from functools import partial

import bench_common as bench
import torch
import torch.distributed as dist

from minipar.collectives import Ledger
from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.moe import take_load
from minipar.ops.hang import start_distributed
from minipar.parallelize import adamw, build_grad_sync
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.train import build_model, train_step

SIDES = ("minipar ep", "minipar ep=1", "torch DDP ep=1", "torch DDP dense")



def parse_args(argv=None):
    p = bench.command_line(__doc__, "four", steps=20, warmup=3)
    p.set_defaults(model="small-moe")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward on one rank")
    p.add_argument("--float64", action="store_true", help="train in float64: the MoE sides' losses then agree closely")
    return bench.parse(p, argv)


def check(args, cfg: TrainConfig, world: int) -> None:
    if not get_config(args.model).n_experts:
        raise ConfigError(f"--model {args.model} has no experts: choose a mixture-of-experts model (small-moe)")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps must be at least 1 and --warmup at least 0")
    cfg.validate(world)


def dense_twin(moe_cfg):
    """A dense model of the MoE's shape whose MLP is as wide as the experts a token uses."""
    return replace(moe_cfg, n_experts=0, ffn_dim=(moe_cfg.top_k + moe_cfg.n_shared_experts) * moe_cfg.expert_ffn_dim)


def build_sides(cfg: TrainConfig, world: int, device, dtype) -> tuple[dict, dict, tuple[Mesh, Mesh]]:
    """The four models, wrapped; {side: wrapper}, {side: its ModelConfig}, and the two meshes (ep, plain)."""
    ledger = Ledger()  # one ledger for both meshes: bench.take_turns resets it before every step
    ep_mesh, plain_mesh = Mesh.build(dp=world, ledger=ledger), Mesh.build(dp=world, ledger=ledger)
    ep_mesh.unflatten(("dp",), edp=1, ep=world)
    moe_cfg = get_config(cfg.model, aux_loss_coef=cfg.aux_loss_coef)
    configs = {"minipar ep": moe_cfg, "minipar ep=1": moe_cfg, "torch DDP ep=1": moe_cfg,
               "torch DDP dense": dense_twin(moe_cfg)}
    sides = {}
    for name, mesh, ep in (("minipar ep", ep_mesh, world), ("minipar ep=1", plain_mesh, 1)):
        c = replace(cfg, ep=ep)
        model, _ = build_model(c, mesh, moe_cfg, device, dtype)
        sides[name] = build_grad_sync(model, mesh.groups(), param_groups(model, c), partial(adamw, lr=c.lr),
                                      zero=c.zero, bucket_mb=c.bucket_mb, offload=c.offload)
    for name in ("torch DDP ep=1", "torch DDP dense"):
        model = Llama(configs[name], seed=cfg.seed).to(device, dtype)
        ids = [device.index] if device.type == "cuda" else None
        sides[name] = bench.TorchDDP(model, adamw(param_groups(model, cfg), cfg.lr), plain_mesh.groups().dp,
                                     bucket_cap_mb=cfg.bucket_mb, device_ids=ids)
    return sides, configs, (ep_mesh, plain_mesh)


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


def held(model) -> dict:
    """Bytes this rank holds: parameters, the experts among them, AdamW state (after a step)."""
    params = list(model.module.named_parameters())
    return {"params": sum(p.numel() * p.element_size() for _, p in params),
            "experts": sum(p.numel() * p.element_size() for n, p in params if ".experts." in n),
            "optimizer": state_bytes(model.optimizer)}


def run(sides: dict, args, cfg: TrainConfig, vocab: int, mesh: Mesh, device) -> dict:
    """All sides in turn on the same batches; this rank's step times, losses, bytes sent, ep's expert load."""
    traffic = {"sent": [], "ledger": [], "ep/1 sent": [], "imbalance": []}
    world = mesh.groups().dp.size

    def note(side: str, measured: bool) -> None:  # right after each step (outside its time)
        load = torch.tensor(take_load(sides[side].module)) if side != "torch DDP dense" else None
        if measured and side == "minipar ep":  # load: [layers, E], this rank's assignments in the step
            dist.all_reduce(load)  # everyone's; then per layer the busiest expert, and ep rank, over the mean
            per_rank = load.view(len(load), world, -1).sum(-1)
            traffic["imbalance"].append([(x.max(1).values / x.double().mean(1)).tolist() for x in (load, per_rank)])
            traffic["sent"].append(mesh.ledger.total_sent())
            traffic["ledger"].append(mesh.ledger.snapshot())
        if measured and side == "minipar ep=1":
            traffic["ep/1 sent"].append(mesh.ledger.total_sent())

    def batch(step: int) -> tuple:
        return (bench.rank_micro_batches(step, cfg, vocab, mesh.coord("dp"), device),)

    steps = {name: partial(train_step, model, grad_clip=cfg.grad_clip) for name, model in sides.items()}
    times, losses = bench.take_turns(steps, batch, args.warmup, args.steps, device, mesh.ledger, note)
    return {"times": times, "losses": losses} | traffic


def summarise(out: dict, sides: dict, configs: dict, cfg: TrainConfig, mesh: Mesh, device) -> dict:
    world = mesh.groups().dp.size
    step_times = bench.across_ranks([out["times"][s] for s in SIDES], mesh.groups().dp, device)
    tokens = cfg.global_batch * cfg.seq_len
    moe = out["losses"]["minipar ep"]
    imbalance = torch.tensor(out["imbalance"]).median(0).values  # [expert / rank, layers]: medians over steps
    r = {"model": cfg.model, "world": world, **bench.machine(device), "steps": len(step_times[0]),
         "global_batch": cfg.global_batch, "micro_batch": cfg.micro_batch, "seq_len": cfg.seq_len,
         "params": {s: configs[s].num_params() for s in SIDES},
         "active_params": {s: configs[s].num_params(active=True) for s in SIDES},
         "dtype": str(next(sides[SIDES[0]].parameters()).dtype),
         "loss_diff_by_step": {f"ep - {s}": [a - b for a, b in zip(moe, out["losses"][s], strict=True)]
                               for s in SIDES[1:3]} | {"ep=1: minipar - DDP": [a - b for a, b in zip(
                                   out["losses"]["minipar ep=1"], out["losses"]["torch DDP ep=1"], strict=True)]},
         "ep_sent_per_step_by_group": {k: statistics.median(s[k]["sent"] for s in out["ledger"])
                                       for k in out["ledger"][0]}, "load_imbalance_per_layer":
             imbalance[0].tolist(), "rank_imbalance_per_layer": imbalance[1].tolist()}
    for i, s in enumerate(SIDES):
        grads = sum(p.numel() * p.element_size() for p in sides[s].module.parameters())
        sent = {"minipar ep": out["sent"], "minipar ep=1": out["ep/1 sent"]}.get(s)
        r[s] = bench.step_stats(step_times[i].tolist(), tokens) | held(sides[s]) | {
            "sent_per_step": statistics.median(sent) if sent else 2 * (world - 1) * grads // world}
    for s in SIDES[1:]:
        r[f"ratio ep / {s}"], r[f"paired ep / {s}"] = bench.ratios(step_times[0], step_times[SIDES.index(s)])
    return r


def report(r: dict, args) -> None:
    mib = 2**20
    print(f"model {r['model']}: {r['params']['minipar ep'] / 1e6:.2f}M params, "
          f"{r['active_params']['minipar ep'] / 1e6:.2f}M active per token; dense twin "
          f"{r['params']['torch DDP dense'] / 1e6:.2f}M | {r['dtype']} | {r['world']} ranks, {r['backend']}, "
          f"{r['device']}, "
          f"{r['threads_per_rank']} thread(s)/rank | global batch {r['global_batch']} x {r['seq_len']} tokens, "
          f"micro-batch {r['micro_batch']} | {args.steps} measured steps each after {args.warmup} warm-up")
    print(bench.table_header(18) + f"{'ep /':>8}  {'params MiB':>11}{'experts':>9}{'AdamW':>8}{'sent/step':>11}")
    for s in SIDES:
        x = r[s]
        ratio = f"{r[f'ratio ep / {s}']:7.3f}x" if s != SIDES[0] else f"{'':>8}"
        print(bench.table_row(s, x, 18) + ratio + f"  {x['params'] / mib:11.2f}{x['experts'] / mib:9.2f}"
              f"{x['optimizer'] / mib:8.2f}{x['sent_per_step'] / mib:9.2f} MiB")
    print("median of step-by-step ratios ep / side: " + ", ".join(f"{s} {r[f'paired ep / {s}']:.3f}x"
                                                                   for s in SIDES[1:]))
    print("minipar ep, bytes sent per step by group (ledger, medians): " + ", ".join(
        f"{k} {v / mib:.2f} MiB" if v > 10_000 else f"{k} {v:g} B" for k, v in r["ep_sent_per_step_by_group"].items()
        if v))
    print("torch DDP sent per step: 2 (N-1)/N x its gradient bytes (formula: DDP's all-reduce is outside the ledger)")
    print("load the ep side saw in a step (median), per MoE layer: busiest expert / mean " + " ".join(
        f"{x:.2f}" for x in r["load_imbalance_per_layer"]) + "; busiest ep rank / mean " + " ".join(
        f"{x:.2f}" for x in r["rank_imbalance_per_layer"]))
    print("same model, same batches, max |loss difference| (at step 1, over all steps): " + ", ".join(
        f"{k} {abs(d[0]):.2g}, {max(map(abs, d)):.2g}" for k, d in r["loss_diff_by_step"].items()))
    bench.write_json(args.json, r)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = bench.world_size()
    cfg = TrainConfig(dp=world, ep=world, model=args.model, seed=args.seed, seq_len=args.seq_len,
                      global_batch=args.global_batch, micro_batch=args.micro_batch)
    if not bench.valid("bench_ep", lambda: check(args, cfg, world)):
        return 2
    torch.set_num_threads(bench.threads_per_rank())
    device = start_distributed()
    dtype = torch.float64 if args.float64 else torch.float32
    sides, configs, (mesh, plain_mesh) = build_sides(cfg, world, device, dtype)
    out = run(sides, args, cfg, configs["minipar ep"].vocab_size, mesh, device)
    results = summarise(out, sides, configs, cfg, mesh, device)
    if dist.get_rank() == 0:
        report(results, args)
    plain_mesh.destroy()
    bench.finish(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
