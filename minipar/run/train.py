"""The training loop: config -> mesh -> data -> plain model -> parallelize -> gradient sync -> steps.

The last chapter of each part of the course: every piece built so far, run together.

    one optimizer step, on each rank:
        rows = this dp rank's slice of the next global batch        (data.py)
        for each micro-batch:            (all but the last inside model.no_sync())
            loss = model(x, y) / accum_steps; loss.backward()       (buckets all-reduce on the last)
        model.finish_grad_sync()                                   (data_parallel.py)
        model.clip_and_step(): clip the global gradient norm; AdamW step
        lr <- warm-up then cosine

`run` is the outline of a run; `save` the checkpoint policy; `run_log.RunLog` what a run shows. A
step with a non-finite gradient norm is skipped (clip_and_step), `--max-bad-steps` in a row stop
the run, and non-finite weights are never saved. Everything checkable is checked before
torch.distributed starts (config.py): a bad command line costs one line, not a hang.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import signal
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from minipar.collectives import Group, all_reduce, barrier
from minipar.context_parallel import split_sequence
from minipar.data_parallel import GradSync, loss_divisor, param_groups
from minipar.grad_sync import adamw, build_grad_sync
from minipar.mesh import Mesh
from minipar.model import Llama
from minipar.moe import set_aux_scale
from minipar.parallelize import parallelize
from minipar.pipeline.executor import Pipeline
from minipar.planning.planner import check_memory, report
from minipar.run import checkpoint
from minipar.run.batches import TokenData
from minipar.run.config import ConfigError, TrainConfig, effective, parse_args
from minipar.run.data import DataError, find_files, prepare
from minipar.run.preflight import check_files, init_model_config
from minipar.run.run_log import RunLog
from minipar.run.validation import is_due, validate, validation_batches

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


def train_step(model: GradSync, micro_batches, grad_clip: float = 0.0, autocast=nullcontext,
               pipeline: Pipeline | None = None):
    """One optimizer step over this rank's micro-batches. Returns (loss, gradient norm); a
    pipeline keeps the measured timeline of its step in `pipeline.timeline`.

    The loss is the mean over every real (not -100) target of the *global* batch, whatever the
    layout: each micro-batch contributes its sum of token losses / loss_divisor, so accumulation,
    pipeline micro-batches, the dp average and cp's split sequences add up to one division by
    the global count. With a pipeline the schedule runs the micro-batches (the loss is known on
    the last stage only) and the data-parallel average waits until its last backward. `model`
    is any gradient-sync wrapper (DataParallel, ZeRO 1/2/3): they share one protocol.
    """
    set_aux_scale(model.module, 1 / len(micro_batches))  # MoE: the step's mean load-balancing loss
    divisor = loss_divisor(micro_batches, model.group)
    if pipeline is not None:
        with model.no_sync(), autocast():
            total = pipeline.run(model.module, micro_batches, divisor)
    else:
        n = len(micro_batches)
        total = 0.0  # becomes a device tensor: no host sync until the step's end
        for i, (x, y) in enumerate(micro_batches):
            with model.no_sync() if i < n - 1 else nullcontext():
                with autocast():
                    loss = model(x, y, divisor)
                loss.backward()
            total = total + loss.detach()
    model.finish_grad_sync()  # average over dp (ZeRO: reduce-scatter to each rank's slice)
    return float(total), model.clip_and_step(grad_clip, pipeline.group if pipeline else None)


# ----------------------------------------------------------------------------------------------
# Setting up
# ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_distributed(timeout: float | None = None) -> torch.device:
    """NCCL on GPUs, gloo on CPU. Without torchrun, a world of one. timeout: seconds (None: torch's)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    limit = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if "RANK" in os.environ:
        if backend == "nccl":  # one GPU per local rank (ranks beyond the GPU count share them)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        dist.init_process_group(backend, **limit)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                **limit)
        if backend == "nccl":
            torch.cuda.set_device(0)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def exit_with_parent() -> None:
    """Under torchrun, ask Linux to SIGTERM this worker when torchrun dies, even by kill -9: no
    orphaned worker trains on alone, holding its GPU and --out's lock."""
    if sys.platform == "linux" and "TORCHELASTIC_RUN_ID" in os.environ:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def check_paths(cfg: TrainConfig) -> Path | None:
    """File-system checks, before any process group: data, the checkpoint to resume, --out. Then
    rank 0 locks --out for the run (and clears what an interrupted save left there)."""
    find_files(cfg.data)  # raises DataError when missing
    source = cfg.resume
    if cfg.resume == "auto":  # self-resume (torchrun --max-restarts): --out's newest checkpoint, if any yet
        if cfg.out is None:
            raise ConfigError("--resume auto needs --out: the folder the run saves to and continues from")
        source = cfg.out if checkpoint.checkpoints(cfg.out) else None
    skipped: list[str] = []
    resume = checkpoint.resolve(source, skipped) if source else None
    if cfg.out is None:  # continue where we resume, else a fresh numbered folder
        cfg.out = str(resume.parent) if resume else next(
            f"runs/run_{i:03d}" for i in range(1, 10**4) if not Path(f"runs/run_{i:03d}").exists()
        )
    if cfg.init_from:  # weights to start from: a checkpoint folder, or the newest in an --out folder
        cfg.init_from = str(checkpoint.resolve(cfg.init_from, flag="--init-from"))
    check_files(cfg, resume)  # the data is text, --out and the logs writable, the checkpoint of this run
    start = json.loads((resume / "train_state.json").read_text())["step"] if resume else 0
    later = [p.name for p in checkpoint.checkpoints(cfg.out) if int(p.name[5:]) > start]
    if later:  # this run would save over them: refuse, whether they are another run's or this one's future
        raise ConfigError(
            f"--out {cfg.out} already holds checkpoints {f'after {resume}' if resume else 'of an earlier run'} "
            f"({later[0]}{f' ... {later[-1]}' if len(later) > 1 else ''}): continue the newest with --resume "
            f"{cfg.out}, or choose another --out (nothing is overwritten)"
        )
    if os.environ.get("RANK", "0") == "0":
        for note in [f"skipped {s}" for s in skipped] + checkpoint.lock(cfg.out):
            print(f"minipar: {note}", flush=True)
    return resume


def load_data(cfg: TrainConfig, resume: Path | None, group: Group) -> TokenData:
    """Tokenised once per machine (local rank 0); the other ranks (`group`: all) wait and read the cache. The
    tokenizer: --tokenizer, else a resumed checkpoint's (the same ids, even if the cache is gone),
    else a BPE trained on the data."""
    saved = resume / "tokenizer.json" if resume is not None and (resume / "tokenizer.json").exists() else None
    args: tuple = (cfg.data, cfg.bpe_vocab, cfg.cache_dir, cfg.tokenizer or saved, cfg.token_dtype)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        prepare(*args)
    barrier(group)
    data = TokenData(prepare(*args), cfg.seq_len, cfg.seed, cfg.val_fraction)
    validation_batches(cfg, data)  # raises DataError when too little is held out
    return data


def precision(cfg: TrainConfig, device: torch.device):
    """(compute dtype, parameter dtype, autocast context): bf16 autocast keeps fp32 master weights."""
    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[
        cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    if dtype == torch.bfloat16:
        return dtype, torch.float32, lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return dtype, dtype, nullcontext


def build_model(cfg: TrainConfig, mesh: Mesh, model_cfg, device, param_dtype):
    """The plain model, parallelized for this rank: (model, pipeline or None)."""
    pipeline = Pipeline(mesh.pp_group, cfg.schedule, model_cfg.n_layers, cfg.virtual_stages,
                        grad_group=mesh.pp_grad_group, seq_shards=cfg.tp if cfg.sp else 1) if cfg.pp > 1 else None
    model = parallelize(Llama(model_cfg, seed=cfg.seed), mesh, sp=cfg.sp, recompute=cfg.recompute, pipeline=pipeline)
    return model.to(device=device, dtype=param_dtype), pipeline


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, resume: Path | None) -> list[float]:
    device = start_distributed(cfg.timeout)
    torch.manual_seed(cfg.seed)
    mesh = Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, timeout=cfg.timeout)
    if cfg.ep > 1:  # experts: the dp x cp ranks reshaped to edp x ep
        mesh.unflatten(("dp", "cp"), edp=cfg.dp * cfg.cp // cfg.ep, ep=cfg.ep)
    log = RunLog(cfg, mesh, device)
    log.say(effective(cfg))
    log.say(mesh.layout.table())
    if cfg.ep > 1:
        log.say(f"experts: the dp x cp ranks as edp {cfg.dp * cfg.cp // cfg.ep} x ep {cfg.ep}; this rank's ep group "
                f"{mesh.group('ep').ranks}, edp group {mesh.group('edp').ranks}")
    data = load_data(cfg, resume, log.group)
    log.measure_memory_from_here()  # the run's own memory: not the tokenizer's peak
    dtype, param_dtype, autocast = precision(cfg, device)
    # The preset with the shape flags (the tokenizer fits its vocabulary); weights to start from bring their RoPE.
    model_cfg = init_model_config(cfg) if cfg.init_from else cfg.model_config()
    model, pipeline = build_model(cfg, mesh, model_cfg, device, param_dtype)
    if cfg.init_from:  # each rank reads only its shards of the weights
        checkpoint.load_weights(Path(cfg.init_from), model, mesh.groups())
        log.say(f"started from the weights of {cfg.init_from}")
    start, consumed, saved_states = 0, 0, None
    if resume is not None:  # weights first: ZeRO builds its master slices from them
        state, saved_states = checkpoint.load(resume, model, mesh.groups())  # each rank takes its shards
        start, consumed = state["step"], state["consumed"]
        log.say(f"resumed from {resume} at step {start}")
    # Each gradient is averaged over the group its Placement names (dense: dp x cp), by --zero's wrapper.
    wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr),
                              zero=cfg.zero, bucket_mb=cfg.bucket_mb, offload=cfg.offload)
    if saved_states is not None:
        wrapper.load_state_by_name(saved_states)
    log.start(model_cfg, data, dtype, start)
    try:
        train_loop(cfg, start, consumed, data, mesh, wrapper, pipeline, autocast, device, log)
    except RuntimeError as e:  # DistBackendError too: a rank stopped answering? name what we waited for
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise RankTimeout(hang_report(cfg, mesh.ledger, e)) from None
    log.close()
    mesh.destroy()
    dist.destroy_process_group()
    return log.losses


def train_loop(cfg, start, consumed, data, mesh, wrapper, pipeline, autocast, device, log) -> None:
    """The steps, from `start`: batch, step, log, and the checkpoint policy."""
    bad = 0  # consecutive steps skipped for a non-finite gradient norm
    for step in range(start, cfg.steps):
        for group in wrapper.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = data.rank_batch(consumed, cfg.global_batch, mesh.dp_rank, cfg.dp)
        x, y = split_sequence(x, mesh.cp_group), split_sequence(y, mesh.cp_group)  # zigzag share (cp)
        micro = list(zip(x.to(device).split(cfg.micro_batch), y.to(device).split(cfg.micro_batch)))
        mesh.ledger.reset()
        log.tick()
        loss, grad_norm = train_step(wrapper, micro, cfg.grad_clip, autocast, pipeline)
        consumed += cfg.global_batch
        log.step(step, loss, grad_norm, lr_at(step, cfg), wrapper, pipeline)
        if is_due(cfg, step + 1):
            log.validation(step, validate(cfg, data, mesh, wrapper, pipeline, autocast, device), pipeline,
                           validation_batches(cfg, data) * cfg.global_batch)
        bad = 0 if math.isfinite(grad_norm) else bad + 1  # the norm is global: every rank agrees
        if bad:
            log.say(f"step {step + 1}: non-finite gradient norm ({grad_norm}): step skipped, weights unchanged "
                    f"({bad} of --max-bad-steps {cfg.max_bad_steps} in a row)")
        if bad >= cfg.max_bad_steps:
            raise TrainingStopped(f"the run diverged: {bad} steps in a row with a non-finite loss or gradient "
                                  f"(last at step {step + 1}); resume from the last checkpoint in {cfg.out} with a "
                                  f"lower --lr or longer --warmup and --allow-config-change")
        if step + 1 == cfg.steps or (cfg.save_every and (step + 1) % cfg.save_every == 0):
            save(cfg, step + 1, consumed, wrapper, mesh, log, data)
        kill_for_test(cfg, step + 1)


def kill_for_test(cfg: TrainConfig, step: int) -> None:
    """A test hook (tests/test_resume.py), off unless MINIPAR_TEST_KILL_AT_STEP=N is set: rank 1
    dies by SIGKILL after step N, once (a marker in --out spares the restarted run)."""
    marker = Path(cfg.out) / ".test-killed"
    if os.environ.get("MINIPAR_TEST_KILL_AT_STEP") == str(step) and os.environ.get("RANK") == "1":
        if not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


class TrainingStopped(RuntimeError):
    """The run cannot go on (it diverged); the message says why and what to do."""


class RankTimeout(RuntimeError):
    """Another rank did not answer within --timeout; the message names what this rank waited for."""


def save(cfg: TrainConfig, step: int, consumed: int, wrapper: GradSync, mesh: Mesh, log: RunLog,
         data: TokenData) -> None:
    """Every rank helps gather the tp shards and pp stages into full tensors; rank 0 writes them,
    with the data's fingerprint and tokenizer. A non-finite weight anywhere stops the run instead:
    nothing bad is ever saved."""
    with wrapper.gathered():
        finite = torch.tensor([float(all(torch.isfinite(p).all() for p in wrapper.module.parameters()))],
                              device=next(wrapper.module.parameters()).device)
    all_reduce(finite, log.group, op="min")  # every rank decides alike
    if not finite.item():
        raise TrainingStopped(f"not saving step {step}: the weights hold non-finite values (the run diverged); the "
                              f"last good checkpoint in {cfg.out} is kept: resume from it with a lower --lr and "
                              f"--allow-config-change")
    states = wrapper.state_by_name()
    with wrapper.gathered():  # ZeRO-3: the weights are sharded
        full = checkpoint.gather_full(wrapper.module, states, checkpoint.hyper_params(wrapper.optimizer),
                                      mesh.groups())
    if log.is_main:
        state = {"step": step, "consumed": consumed, "config": asdict(cfg), "data_key": data.fingerprint,
                 "model_config": asdict(wrapper.module.config)}  # what the weights are of (sample.py, convert.py)
        path = checkpoint.save(cfg.out, step, *full, state, data.tokenizer_file)
        log.say(f"saved {path}")
    barrier(log.group)


def main(argv=None) -> int:
    """Parse, check, run. A bad command line or input prints one line and exits 2."""
    is_main = int(os.environ.get("RANK", "0")) == 0
    exit_with_parent()
    local = False  # the command line reads alike on every rank; memory and files are each node's own
    try:
        cfg = parse_args(argv)
        if cfg.plan:
            print(report(cfg))
            return 0
        local = True
        check_memory(cfg)  # weights, gradients, optimizer state and activations must fit
        resume = check_paths(cfg)
    except ValueError as e:  # ConfigError, LayoutError, DataError, CheckpointError
        if not is_main:  # rank 0 says what every rank found; a node's own problem its ranks say, after it
            if not local:
                return 2
            time.sleep(2.0)  # if rank 0 failed too, torchrun has ended this rank by now
        where = "" if is_main else f"rank {os.environ['RANK']}: "
        print(f"minipar: error: {where}{e}", file=sys.stderr, flush=True)
        return 2
    try:
        run(cfg, resume)
    except TrainingStopped as e:
        if is_main:
            print(f"minipar: error: {e}", file=sys.stderr)
        return 3
    except DataError as e:  # found while tokenising, alike on every rank (too little held out)
        if is_main:
            print(f"minipar: error: {e}", file=sys.stderr)
        return 2
    except RankTimeout as e:  # printed by every rank that gave up: the others may be the stopped ones
        print(f"minipar: error: {e}", file=sys.stderr)
        return 4
    finally:
        if is_main:  # killed instead (torchrun restarting us)? The next rank 0 takes the stale lock over
            checkpoint.unlock(cfg.out)
    return 0


def hang_report(cfg: TrainConfig, ledger, error: Exception) -> str:
    """One line: which rank gave up, after how long, and the last operation it had asked of others."""
    rank, last = os.environ.get("RANK", "0"), ledger.last
    if last is None:
        return f"rank {rank}: a collective failed ({str(error).splitlines()[0][:200]})"
    group, op, ranks, peer = last
    waits = f", from rank {peer}" if peer is not None else f" with ranks {list(ranks)}"
    return (f"rank {rank}: no answer within --timeout {cfg.timeout:g} s; the last operation it asked of others "
            f"was {group}/{op}{waits} (a rank there stopped, died or runs a different step); the job stops")
