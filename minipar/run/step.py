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


def loss_divisor(micro_batches, group, replicas=None) -> float:
    """The global batch's count of real targets (summed over `group`, dp x cp) / group.size: the
    wrappers divide the summed gradient by that size, so the whole is one division by the count.
    An all-ignored batch divides by 1: its loss and gradients are 0, not NaN. Replica groups
    (run/replicas.py): the count is summed over the groups taking part too, and divided by them."""
    count = sum((y != -100).sum() for _, y in micro_batches).to(torch.float64).reshape(1)
    all_reduce(count, group)  # 8 bytes, once per step
    if replicas is not None:
        replicas.sum(count)
    return max(float(count.item()), 1.0) / (group.size * (replicas.size if replicas is not None else 1))


def begin_step(model: GradSync, micro: list, replicas=None) -> float:
    """Ready the wrapped model for a step over `micro`: each MoE block's auxiliary loss weighs
    1/len(micro). Returns the divisor of each micro-batch's sum of token losses (`loss_divisor`)."""
    set_aux_scale(model.module, 1 / len(micro))
    return loss_divisor(micro, model.group, replicas)


def take_expert_load(model: GradSync) -> list[list[int]]:
    """MoE: this rank's assignments per expert in each block since the last call; counting restarts."""
    return take_load(model.module)
