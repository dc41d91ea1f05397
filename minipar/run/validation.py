"""Validation: the loss on held-out documents, under any layout, leaving the weights untouched.

`--val-fraction F` holds out F of the documents (batches.py); every `--eval-every` steps and at
the end, the run measures the loss on the same `--eval-batches` global batches of them. The sum
is train_step's, forward only:

    each micro-batch:  sum of its token losses / divisor           (no backward, no optimizer)
    summed over the micro-batches of this rank                     (pipeline: the last stage's)
    the run log averages it over the ranks that hold the loss      (run_log.RunLog.validation)

so, as for the training loss, dp and cp's shares add up to one division by the global batch's
count of targets, tp ranks agree, and a pipeline runs its forward actions alone
(Pipeline.forward_actions). The micro-batches, the divisor and the expert counts are the
training step's (step.py). No gradient is made (torch.no_grad), so no gradient hook fires,
ZeRO-3 gathers and frees each layer as in a training forward, and an MoE block adds no
auxiliary loss; its expert counts are dropped so that the log shows training tokens only.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from minipar.run.batches import TokenData
from minipar.run.data import DataError
from minipar.run.step import begin_step, micro_batches_of, take_expert_load


def is_due(cfg, step: int) -> bool:
    """Validate after step `step` (counted from 1)? Every --eval-every steps, and at the end."""
    return cfg.val_fraction > 0 and (step == cfg.steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0))


def validation_batches(cfg, data: TokenData) -> int:
    """How many global batches each validation reads: --eval-batches, or fewer if the held-out
    documents hold fewer. None at all is refused with one line."""
    whole = len(data.val_windows) // cfg.global_batch
    if cfg.val_fraction and whole < 1:
        raise DataError(f"--val-fraction {cfg.val_fraction} holds out {data.val_docs} document(s), "
                        f"{len(data.val_windows)} window(s) of --seq-len {cfg.seq_len}: fewer than one --global-batch "
                        f"{cfg.global_batch}; hold out more, or use more data")
    return min(cfg.eval_batches, whole)


@torch.no_grad()
def validation_loss(model, micro_batches, autocast=nullcontext, pipeline=None) -> torch.Tensor | float:
    """This rank's share of one global batch's mean token loss, as train_step sums it. `model`
    is the gradient-sync wrapper (ZeRO-3's gathers its layers in forward)."""
    divisor = begin_step(model, micro_batches)
    with autocast():
        if pipeline is not None:
            return pipeline.run_forward(model.module, micro_batches, divisor)
        return sum(model(x, y, divisor) for x, y in micro_batches)


def validate(cfg, data: TokenData, mesh, model, pipeline, autocast, device) -> float:
    """This rank's share of the mean loss over the held-out batches (see the module docstring)."""
    batches, total = validation_batches(cfg, data), 0.0
    for k in range(batches):
        rows = data.rank_val_batch(k, cfg.global_batch, mesh.coord("dp"), cfg.dp)
        micro = micro_batches_of(rows, mesh, cfg.micro_batch, device)
        total += float(validation_loss(model, micro, autocast, pipeline))
    take_expert_load(model)  # dropped: the next log line counts training tokens only
    return total / batches
