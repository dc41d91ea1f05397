"""The training loop: config -> mesh -> data -> model -> data-parallel wrapper -> steps.

The last chapter of each part of the course: every piece built so far, run together.

    one optimizer step, on each rank:
        rows = this dp rank's slice of the next global batch        (data.py)
        for each micro-batch:            (all but the last inside model.no_sync())
            loss = model(x, y) / accum_steps; loss.backward()       (buckets all-reduce on the last)
        model.finish_grad_sync()                                   (data_parallel.py)
        clip the global gradient norm; AdamW step; lr <- warm-up then cosine

Everything that can be checked is checked before torch.distributed starts (config.py), so a bad
command line costs one line, not a hang.
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from minipar import checkpoint
from minipar.collectives import Group, Ledger, all_gather, all_reduce
from minipar.config import ConfigError, TrainConfig, parse_args
from minipar.context_parallel import split_sequence
from minipar.data import TokenData, find_files, prepare
from minipar.data_parallel import DataParallel
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import parallelize
from minipar.pipeline import Pipeline
from minipar.placement import placement_of
from minipar.tensor_parallel import sync_partial_grads
from minipar.zero import ZeroDataParallel
from minipar.zero3 import Zero3DataParallel

# Dense bfloat16 peak FLOP/s, for model FLOPs utilisation (MFU) on known GPUs.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


# ----------------------------------------------------------------------------------------------
# Pieces of a step, small enough to test on their own
# ----------------------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to cfg.lr over cfg.warmup steps, then cosine down to min_lr_ratio * lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict]:
    """Weight decay on matrices only (not on norm gains), as is usual for transformers."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_adamw(groups: list[dict], cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    return make_adamw(param_groups(model, cfg), cfg)


def clip_grad_norm(params, max_norm: float, tp_group: Group, pp_group: Group | None = None) -> float:
    """The global gradient norm, and clipping to max_norm (0: no clipping).

    A tensor-parallel shard holds only part of its parameter, so the squares of sharded gradients
    are summed over tp; replicated parameters are counted once; pipeline stages hold different
    parameters, so their sums are added over pp. Same formula as torch.nn.utils.clip_grad_norm_:
    scale by max_norm / (norm + 1e-6) when that is below 1.
    """
    grads = [p for p in params if p.grad is not None]
    sharded = [p.grad for p in grads if placement_of(p).is_sharded("tp")]
    replicated = [p.grad for p in grads if not placement_of(p).is_sharded("tp")]
    sq = torch.stack([g.pow(2).sum() for g in sharded]).sum() if sharded else grads[0].grad.new_zeros(())
    all_reduce(sq, tp_group)
    if replicated:
        sq = sq + torch.stack([g.pow(2).sum() for g in replicated]).sum()
    all_reduce(sq, pp_group or Group.solo("pp"))
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in grads:
            p.grad.mul_(coef)
    return float(norm)


def train_step(model: DataParallel | ZeroDataParallel, optimizer, micro_batches, grad_clip: float = 0.0,
               autocast=nullcontext, tp_group: Group | None = None, pipeline: Pipeline | None = None):
    """One optimizer step over this rank's micro-batches. Returns (mean loss, gradient norm); a
    pipeline keeps the measured timeline of its step in `pipeline.timeline`.

    Each micro-batch's loss is divided by their number, so the accumulated gradient is the mean
    over the rank's rows; the data-parallel average then makes it the global-batch mean. With a
    pipeline the schedule runs the micro-batches (the loss is known on the last stage only) and
    the data-parallel average waits until its last backward.
    """
    tp_group = tp_group or Group.solo("tp")
    if pipeline is not None:
        with model.no_sync(), autocast():
            total = pipeline.run(model.module, micro_batches)
    else:
        n = len(micro_batches)
        total = 0.0  # becomes a device tensor: no host sync until the step's end
        for i, (x, y) in enumerate(micro_batches):
            with model.no_sync() if i < n - 1 else nullcontext():
                with autocast():
                    loss = model(x, y) / n
                loss.backward()
            total = total + loss.detach()
    model.finish_grad_sync()  # average over dp (ZeRO: reduce-scatter to each rank's slice)
    pp_group = pipeline.group if pipeline else None
    if isinstance(model, ZeroDataParallel):  # it owns the optimizer and the gradient slices
        return float(total), model.clip_and_step(grad_clip, pp_group)
    sync_partial_grads(model, tp_group)  # sum the partial gradients of replicated tp parameters
    grad_norm = clip_grad_norm(model.parameters(), grad_clip, tp_group, pp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total), grad_norm


# ----------------------------------------------------------------------------------------------
# Setting up
# ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_distributed() -> torch.device:
    """NCCL on GPUs, gloo on CPU. Without torchrun, a world of one."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        if backend == "nccl":  # one GPU per local rank (ranks beyond the GPU count share them)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        if backend == "nccl":
            torch.cuda.set_device(0)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def check_paths(cfg: TrainConfig) -> Path | None:
    """File-system checks, before any process group: data, the checkpoint to resume, --out."""
    find_files(cfg.data)  # raises DataError when missing
    resume = None
    if cfg.resume:
        resume = checkpoint.resolve(cfg.resume)
        checkpoint.verify(resume)
    if cfg.out is None:  # continue where we resume, else a fresh numbered folder
        cfg.out = str(resume.parent) if resume else next(
            f"runs/run_{i:03d}" for i in range(1, 10**4) if not Path(f"runs/run_{i:03d}").exists()
        )
    elif resume is None and any(Path(cfg.out).glob("step_*")):
        raise ConfigError(
            f"--out {cfg.out} already holds checkpoints of an earlier run: continue it with --resume "
            f"{cfg.out}, or choose another --out (nothing is overwritten)"
        )
    return resume


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set (Linux: KiB)


def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients (during a step) and optimizer state."""
    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    params = nbytes(model.module.parameters())
    optim = nbytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    if isinstance(model, ZeroDataParallel):  # weights present now (ZeRO-3: none), master and gradient slices
        return {"params": model.param_bytes(), "grads": model.gradient_bytes(), "optimizer": optim}
    # A full gradient per parameter, plus DataParallel's flat bucket buffers (kept between steps).
    buffers = nbytes(b.buffer for b in getattr(model, "buckets", []) if b.buffer is not None)
    return {"params": params, "grads": params + buffers, "optimizer": optim}


def per_group_sent(ledger: Ledger) -> str:
    """' (dp 3.50, tp 1.20 MiB)': this rank's bytes sent this step, by group."""
    groups: dict[str, int] = {}
    for (group, _op), entry in ledger.entries.items():
        groups[group] = groups.get(group, 0) + entry.sent
    parts = [f"{g} {b / 2**20:.2f}" for g, b in sorted(groups.items()) if b]
    return f" ({', '.join(parts)} MiB)" if len(parts) > 1 else ""


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((f for key, f in PEAK_BF16_FLOPS.items() if key in name), None)


def start_wandb(cfg: TrainConfig):
    """wandb on rank 0: online if the user has logged in (or set WANDB_MODE), otherwise offline."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if wandb.login(prompt=False) else "offline")
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    return wandb.init(project="minipar", config=asdict(cfg), mode=mode, dir=cfg.out)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, resume: Path | None) -> list[float]:
    device = start_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    say = print if is_main else (lambda *a, **k: None)
    torch.manual_seed(cfg.seed)

    mesh = Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp)
    say(mesh.layout.table())
    # Per-step metrics travel over their own group with its own ledger, so the model's ledger
    # shows only the traffic of training itself.
    log_group = Group("log", dist.group.WORLD, list(range(world)), Ledger())

    # Data: tokenised once per machine (local rank 0), the other ranks wait and read the cache.
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        folder = prepare(cfg.data, cfg.vocab_size, cfg.cache_dir)
    dist.barrier()
    folder = prepare(cfg.data, cfg.vocab_size, cfg.cache_dir)
    data = TokenData(folder, cfg.seq_len, cfg.seed)

    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[
        cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    ]
    param_dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # bf16: fp32 master weights
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if dtype == torch.bfloat16 else nullcontext
    model_cfg = get_config(cfg.model, vocab_size=data.vocab_size)
    # With pp > 1 this rank builds only its stages' layers (and the embedding / head if it has them).
    pipeline = Pipeline(mesh.pp_group, cfg.schedule, model_cfg.n_layers, cfg.virtual_stages,
                        grad_group=mesh.pp_grad_group, seq_shards=cfg.tp if cfg.sp else 1) if cfg.pp > 1 else None
    model = parallelize(Llama(model_cfg, seed=cfg.seed), mesh, sp=cfg.sp, recompute=cfg.recompute, pipeline=pipeline)
    model = model.to(device=device, dtype=param_dtype)
    start, consumed, saved_states = 0, 0, None
    if resume is not None:  # weights first: ZeRO builds its master slices from them
        state, saved_states = checkpoint.load(resume, model, mesh.tp_group)  # each rank takes its shards
        start, consumed = state["step"], state["consumed"]
        say(f"resumed from {resume} at step {start}")
    # Replicated parameters are averaged over data *and* context replicas: each cp rank saw only
    # its share of the tokens (context_parallel.py). ZeRO shards over the same group.
    grad_group = mesh.dp_cp_group if cfg.cp > 1 else mesh.dp_group
    if cfg.zero == 3:
        dp_model = Zero3DataParallel(model, grad_group, lambda groups: make_adamw(groups, cfg),
                                     param_groups(model, cfg), tp_group=mesh.tp_group)
    if cfg.zero in (1, 2):
        dp_model = ZeroDataParallel(model, grad_group, cfg.zero, lambda groups: make_adamw(groups, cfg),
                                    param_groups(model, cfg), cfg.bucket_mb, mesh.tp_group, cfg.offload)
    if cfg.zero:
        optimizer = dp_model.optimizer
        if saved_states is not None:
            dp_model.load_state_by_name(saved_states)
    else:
        dp_model = DataParallel(model, grad_group, bucket_mb=cfg.bucket_mb)
        optimizer = build_optimizer(model, cfg)
        if saved_states is not None:
            checkpoint.set_optimizer_state(model, optimizer, saved_states)

    tokens_per_step = cfg.global_batch * cfg.seq_len
    flops_per_step = model_cfg.flops_per_token(cfg.seq_len) * tokens_per_step
    peak = peak_flops(device)
    say(f"model {cfg.model}: {model_cfg.num_params() / 1e6:.2f}M parameters, vocab {data.vocab_size}, "
        f"{data.num_windows} windows of {cfg.seq_len} tokens; {cfg.accum_steps} micro-batch(es) of "
        f"{cfg.micro_batch} per rank per step; {device.type}, {dtype}")

    wandb_run = start_wandb(cfg) if (cfg.wandb and is_main) else None
    log_file = open(cfg.log_json, "a") if (cfg.log_json and is_main) else None
    from tqdm import tqdm

    bar = tqdm(total=cfg.steps, initial=start, disable=not is_main or None, desc="train", unit="step")
    losses = []
    for step in range(start, cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = data.rank_batch(consumed, cfg.global_batch, mesh.dp_rank, cfg.dp)
        x, y = split_sequence(x, mesh.cp_group), split_sequence(y, mesh.cp_group)  # zigzag share (cp)
        micro = list(zip(x.to(device).split(cfg.micro_batch), y.to(device).split(cfg.micro_batch)))
        mesh.ledger.reset()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, grad_norm = train_step(dp_model, optimizer, micro, cfg.grad_clip, autocast, mesh.tp_group, pipeline)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        consumed += cfg.global_batch

        # Every rank's loss, peak memory and pipeline idle time, gathered for the log. The loss is
        # the mean over the ranks that compute it (the last pipeline stage; all ranks without pp).
        has_loss = pipeline is None or pipeline.holds_last()
        mine = [loss, float(peak_memory_bytes(device)), float(has_loss), pipeline.bubble if pipeline else 0.0]
        metrics = all_gather(torch.tensor(mine, dtype=torch.float64, device=device), log_group).view(world, 4).cpu()
        loss = (metrics[:, 0] * metrics[:, 2]).sum().item() / metrics[:, 2].sum().item()
        bubble = metrics[:, 3].mean().item() if pipeline else None
        losses.append(loss)
        sent = mesh.ledger.total_sent()
        record = {
            "step": step + 1, "loss": loss, "grad_norm": grad_norm, "lr": lr_at(step, cfg),
            "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
            "mfu": flops_per_step / dt / (world * peak) if peak else None,
            "bytes_sent": sent, "comm": mesh.ledger.snapshot(),
            "peak_memory": [int(m) for m in metrics[:, 1].tolist()],
            "bubble": bubble,  # measured: the mean over ranks of the pipeline's time spent waiting
            "held_bytes": held_bytes(dp_model, optimizer),  # this rank's, measured on its tensors
        }
        if log_file:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        if wandb_run:
            skip = ("comm", "peak_memory", "mfu", "bubble", "held_bytes")
            wandb_run.log({k: v for k, v in record.items() if k not in skip}
                          | {"peak_memory_max": max(record["peak_memory"])}, step=step + 1)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        if is_main and step == start:
            held = record["held_bytes"]
            tqdm.write(f"rank 0 holds {held['params'] / 2**20:.2f} MiB of parameters, {held['grads'] / 2**20:.2f} "
                       f"MiB of gradients, {held['optimizer'] / 2**20:.2f} MiB of optimizer state", file=sys.stdout)
        if is_main and ((step + 1) % cfg.log_every == 0 or step == start or step + 1 == cfg.steps):
            mfu = f"{record['mfu']:.1%}" if record["mfu"] is not None else "n/a (cpu)"
            tqdm.write(f"step {step + 1:>5}/{cfg.steps} | loss {loss:.4f} | lr {record['lr']:.2e} | "
                       f"grad {grad_norm:.3f} | {record['tokens_per_s']:,.0f} tok/s | mfu {mfu} | "
                       f"peak mem {max(record['peak_memory']) / 2**20:,.0f} MiB | "
                       + (f"bubble {bubble:.0%} | " if pipeline else "") +
                       f"sent {sent / 2**20:.2f} MiB/step{per_group_sent(mesh.ledger)}", file=sys.stdout)
        last = step + 1 == cfg.steps
        if last or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            # Every rank helps gather the tp shards and pp stages into full tensors; rank 0 writes them.
            states = dp_model.state_by_name() if cfg.zero else checkpoint.optimizer_state(model, optimizer)
            with dp_model.gathered() if cfg.zero else nullcontext():  # ZeRO-3: the weights are sharded
                full = checkpoint.gather_full(model, states, checkpoint.hyper_params(optimizer), mesh.tp_group,
                                              mesh.pp_group)
            if is_main:
                path = checkpoint.save(cfg.out, step + 1, *full,
                                       {"step": step + 1, "consumed": consumed, "config": asdict(cfg)})
                tqdm.write(f"saved {path}", file=sys.stdout)
            dist.barrier()
    bar.close()
    if log_file:
        log_file.close()
    if wandb_run:
        wandb_run.finish()
    mesh.destroy()
    dist.destroy_process_group()
    return losses


def main(argv=None) -> int:
    """Parse, check, run. A bad command line or input prints one line and exits 2."""
    is_main = int(os.environ.get("RANK", "0")) == 0
    try:
        cfg = parse_args(argv)
        resume = check_paths(cfg)
    except ValueError as e:  # ConfigError, LayoutError, DataError, CheckpointError
        if is_main:
            print(f"minipar: error: {e}", file=sys.stderr)
        return 2
    run(cfg, resume)
    return 0
