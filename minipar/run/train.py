"""The training loop: this rank's model, parallelized and wrapped, then the steps.

Every piece built so far, run together. ops/ has checked the command line and the files, launch.py
built the mesh, the run log and the data; `run` builds the plain model, parallelizes it, wraps it
for gradient sync, loads what it resumes, and runs the steps:

    one optimizer step, on each rank:
        lr <- warm-up then cosine                                  (lr_at)
        micro-batches <- this dp rank's rows of the next global batch, cp's share of each
                         sequence, cut into --micro-batch rows     (step.py, batches.py)
        divisor <- the global batch's real targets / |dp x cp|    (step.begin_step)
        for each micro-batch:            (all but the last inside model.no_sync())
            loss = its sum of token losses / divisor; loss.backward()
                                                                   (buckets all-reduce on the last)
        model.finish_grad_sync()                                   (data_parallel.py)
        model.clip_and_step(): clip the global gradient norm; AdamW step
        log; validate and save when due                            (validation.py, saving.py)

A step with a non-finite gradient norm is skipped (clip_and_step), and `--max-bad-steps` in a row
stop the run; `run_log.RunLog` is what a run shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from minipar import zeropp
from minipar.data_parallel import GradSync
from minipar.mesh import Mesh
from minipar.model import Llama
from minipar.parallelize import build_grad_sync, optimizer_of, parallelize
from minipar.pipeline.executor import Pipeline
from minipar.precision import of_config
from minipar.run import checkpoint, saving, validation
from minipar.run.batches import TokenData
from minipar.run.config import TrainConfig
from minipar.run.run_log import RunLog
from minipar.run.saving import TrainingStopped
from minipar.run.step import StepHooks, begin_step, micro_batches_of

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
               pipeline: Pipeline | None = None, hooks: StepHooks | None = None):
    """One optimizer step over this rank's micro-batches. Returns (loss, gradient norm); a
    pipeline keeps the measured timeline of its step in `pipeline.timeline`.

    The loss is the mean over every real (not -100) target of the *global* batch, whatever the
    layout: each micro-batch contributes its sum of token losses / loss_divisor, so accumulation,
    pipeline micro-batches, the dp average and cp's split sequences add up to one division by
    the global count. With a pipeline the schedule runs the micro-batches (the loss is known on
    the last stage only) and the data-parallel average waits until its last backward. `model`
    is any gradient-sync wrapper (DataParallel, ZeRO 1/2/3): they share one protocol. `hooks`
    (step.py) may count the batch beyond this job and gate the synced gradients: a step the gate
    drops returns the norm None and changes nothing.
    """
    divisor = begin_step(model, micro_batches, hooks)  # and MoE: the step's mean load-balancing loss (step.py)
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
    if hooks is not None:
        total = hooks.loss(total)
    return float(total), model.clip_and_step(grad_clip, pipeline.group if pipeline else None,
                                             hooks.gate if hooks is not None else None)


# ----------------------------------------------------------------------------------------------
# This rank's model
# ----------------------------------------------------------------------------------------------


def precision(cfg: TrainConfig, device: torch.device):
    """(the run's Precision, the dtype the model is built in, autocast context). Default: fp32 on CPU,
    bf16-autocast on CUDA. bf16-mixed builds the model in fp32: the wrapper keeps those weights as
    its masters and turns the model's own into bf16 copies (precision.py)."""
    chosen = of_config(cfg, device.type)
    autocast = nullcontext if chosen.autocast is None else lambda: torch.autocast(device.type, dtype=chosen.autocast)
    return chosen, chosen.built, autocast


def build_model(cfg: TrainConfig, mesh: Mesh, model_cfg, device, param_dtype):
    """The plain model, parallelized for this rank: (model, pipeline or None)."""
    groups, grad_channel = mesh.groups(), mesh.group("pp", channel="grad")
    pipeline = Pipeline(groups.pp, cfg.schedule, model_cfg.n_layers, cfg.virtual_stages, grad_group=grad_channel,
                        seq_shards=cfg.tp if cfg.sp else 1, layer_counts=cfg.stage_counts) if cfg.pp > 1 else None
    stage = (pipeline.my_layers(), pipeline.holds_first(), pipeline.holds_last()) if pipeline else None
    model = parallelize(Llama(model_cfg, seed=cfg.seed), tp=groups.tp, cp=groups.cp, ep=groups.ep, sp=cfg.sp,
                        stage=stage, recompute=cfg.recompute, cp_attention=cfg.cp_attention, tp_overlap=cfg.tp_overlap,
                        recompute_mlp=cfg.recompute_mlp, recompute_selective=cfg.recompute_selective)
    return model.to(device=device, dtype=param_dtype), pipeline


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def run(cfg: TrainConfig, resume: Path | None, mesh: Mesh, data: TokenData, log: RunLog, device,
        hooks_for: Callable | None = None) -> bool:
    """This rank's model, from the seed, --init-from's weights or the checkpoint it resumes; then the
    steps. True if Ctrl-C stopped them early. `hooks_for(cfg, mesh, wrapper, log)`: a plug-in's
    StepHooks for this run (launch.py's extras), or None."""
    chosen, param_dtype, autocast = precision(cfg, device)
    # The preset with the shape flags (the tokenizer fits its vocabulary); weights to start from bring their RoPE.
    model_cfg = checkpoint.init_model_config(cfg, Path(cfg.init_from)) if cfg.init_from else cfg.model_config()
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
    wrapper = build_grad_sync(model, mesh.groups(), *optimizer_of(model, cfg, mesh.groups()),
                              zero=cfg.zero, bucket_mb=cfg.bucket_mb, offload=cfg.offload, precision=chosen,
                              zeropp=zeropp.parse(cfg.zeropp) if cfg.zeropp else ())
    if saved_states is not None:
        wrapper.load_state_by_name(saved_states)
    log.start(model_cfg, data, chosen.name, start)
    hooks = (hooks_for and hooks_for(cfg, mesh, wrapper, log)) or StepHooks()
    try:
        return train_loop(Job(cfg, mesh, data, wrapper, pipeline, autocast, device, log, hooks), start, consumed)
    finally:
        hooks.close()


@dataclass
class Job:
    """This rank's part of the run, as `run` built it: everything the steps read."""

    cfg: TrainConfig
    mesh: Mesh
    data: TokenData
    model: GradSync  # the parallelized model in its gradient-sync wrapper, which holds the optimizer
    pipeline: Pipeline | None  # None: no pp
    autocast: Callable[[], AbstractContextManager]
    device: torch.device
    log: RunLog
    hooks: StepHooks  # a plug-in's part in each step (step.py); the defaults change nothing


def train_loop(job: Job, start: int, consumed: int) -> bool:
    """The steps, from `start` (`consumed` samples in): batch, step, log; validate and save when due.
    True if Ctrl-C stopped them (ops/interrupt.py): after the step where the log's gather said so."""
    cfg, mesh, data, model, pipeline, log = job.cfg, job.mesh, job.data, job.model, job.pipeline, job.log
    bad = 0  # consecutive steps skipped for a non-finite gradient norm
    step, hooks = start, job.hooks
    while step < cfg.steps:
        mesh.ledger.reset()
        step, consumed = hooks.begin(step, consumed)  # a plug-in may move them: a heal from a peer
        if log.interrupt:  # from here a Ctrl-C waits for the end of the step; before, while a plug-in
            log.interrupt.stepping = True  # waits on others (up to --timeout), it stops at once
        for group in model.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)  # Muon's group: its lr / --lr
        rows = hooks.rows(data, consumed, cfg.global_batch, cfg.dp, mesh.coord("dp"))
        micro = micro_batches_of(rows, mesh, cfg.micro_batch, job.device)
        log.tick(step)
        loss, grad_norm = train_step(model, micro, cfg.grad_clip, job.autocast, pipeline, hooks)
        if grad_norm is None:  # the gate dropped the step (its owner said why): no weight changed; again
            continue
        consumed += cfg.global_batch
        stop = log.step(step, loss, grad_norm, lr_at(step, cfg), model, pipeline)  # a rank heard Ctrl-C
        if validation.is_due(cfg, step + 1):
            log.validation(step, validation.validate(cfg, data, mesh, model, pipeline, job.autocast, job.device),
                           pipeline, validation.validation_batches(cfg, data) * cfg.global_batch)
        bad = 0 if math.isfinite(grad_norm) else bad + 1  # the norm is global: every rank agrees
        if bad:
            log.say(f"step {step + 1}: non-finite gradient norm ({grad_norm}): step skipped, weights unchanged "
                    f"({bad} of --max-bad-steps {cfg.max_bad_steps} in a row)")
        if bad >= cfg.max_bad_steps:
            raise TrainingStopped(f"the run diverged: {bad} steps in a row with a non-finite loss or gradient "
                                  f"(last at step {step + 1}); resume from the last checkpoint in {cfg.out} with a "
                                  f"lower --lr or longer --warmup and --allow-config-change")
        if saving.is_due(cfg, step + 1) or stop and cfg.save_on_interrupt:
            saving.save(cfg, step + 1, consumed, model, mesh, log, data, quiet=stop)
        if stop:
            log.say(f"minipar: interrupted: stopped after step {step + 1} of {cfg.steps}, on every rank; "
                    f"{log.interrupt.resume_hint(cfg.out)}")
            return True
        step += 1
    return False
