"""What a step is made of under any layout: the one place that knows how context parallelism and
experts change a step. The training loop (train.py) uses it, validation (validation.py) forward only.

    this dp rank's rows       [b, s]         (batches.TokenData)
      cp: its zigzag share    [b, s/cp]      (context_parallel.split_sequence)
      on the device, cut into micro-batches of --micro-batch rows
    each micro-batch's loss = its sum of token losses / divisor,
      divisor = the global batch's real targets / |dp x cp|   (loss_divisor: the
      wrappers average gradients over dp x cp, each cp rank having seen part of every sequence)
    experts: each micro-batch's load-balancing loss weighs 1/micro-batches (the step's mean), and
      the tokens each expert was given are counted in forward, taken for the log after a step

`StepHooks` is where something outside the loop joins each step: the loop calls them, each default
leaves the step as it is, and a plug-in fills them (chapter 10b's fault tolerance does).
"""

from __future__ import annotations

import torch

from minipar.collectives import all_reduce
from minipar.context_parallel import split_sequence
from minipar.data_parallel import GradSync
from minipar.mesh import Mesh
from minipar.moe import set_aux_scale, take_load


def micro_batches_of(rows: tuple[torch.Tensor, torch.Tensor], mesh: Mesh, micro_batch: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of this dp rank, [b, s] each: their cp share on the device, cut into
    micro-batches of `micro_batch` rows."""
    x, y = (split_sequence(t, mesh.groups().cp).to(device) for t in rows)  # [b, s/cp] zigzag share (cp)
    return list(zip(x.split(micro_batch), y.split(micro_batch)))


class StepHooks:
    """A step as a plug-in sees it; every default changes nothing. The loop calls, in order:

        begin(step, consumed)   before the step: the (step, samples consumed) to take, which a
                                plug-in may move (a group behind takes a peer's state and place)
        rows(data, ...)         the rows this rank trains on: by default its dp share of the batch
        outer_sum(t)            sum the step's target count over whatever shares the batch beyond
                                this job (in place); returns into how many jobs the batch is cut
        loss(total)             the step's loss as logged
        gate(grads)             after the gradients are synced, before the norm: may change them in
                                place (average them further); False drops them and the step is redone
    """

    def begin(self, step: int, consumed: int) -> tuple[int, int]:
        return step, consumed

    def rows(self, data, consumed: int, global_batch: int, dp: int, coord: int):
        return data.rank_batch(consumed, global_batch, coord, dp)

    def outer_sum(self, t: torch.Tensor) -> int:
        return 1

    def loss(self, total):
        return total

    def gate(self, grads: list[torch.Tensor]) -> bool:  # GradSync.clip_and_step asks it
        return True

    def close(self) -> None:
        pass


def loss_divisor(micro_batches, group, hooks: StepHooks | None = None) -> float:
    """The global batch's count of real targets (summed over `group`, dp x cp, and by the hooks over
    jobs sharing the batch) / the ranks it is cut into: the wrappers divide the summed gradient by
    their group's size, so the whole is one division by the count. An all-ignored batch divides by
    1: its loss and gradients are 0, not NaN."""
    count = sum((y != -100).sum() for _, y in micro_batches).to(torch.float64).reshape(1)
    all_reduce(count, group)  # 8 bytes, once per step
    jobs = (hooks or StepHooks()).outer_sum(count)
    return max(float(count.item()), 1.0) / (group.size * jobs)


def begin_step(model: GradSync, micro: list, hooks: StepHooks | None = None) -> float:
    """Ready the wrapped model for a step over `micro`: each MoE block's auxiliary loss weighs
    1/len(micro). Returns the divisor of each micro-batch's sum of token losses (`loss_divisor`)."""
    set_aux_scale(model.module, 1 / len(micro))
    return loss_divisor(micro, model.group, hooks)


def take_expert_load(model: GradSync) -> list[list[int]]:
    """MoE: this rank's assignments per expert in each block since the last call; counting restarts."""
    return take_load(model.module)
