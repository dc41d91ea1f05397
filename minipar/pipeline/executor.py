"""Pipeline parallelism: stages of layers, and the one executor that runs any schedule (chapter 6).

    pp = 2, 4 layers:      rank 0 (stage 0)                 rank 1 (stage 1)
                           tok_emb, layers 0-1   -- x -->   layers 2-3, norm, lm_head, loss
                                                 <-- dx --

`stage_layers` cuts the layers into contiguous blocks, the extra ones to the first stages. `Pipeline`
walks this rank's actions (schedules.py) in order, posting what `schedules.messages_of` names for each:
F receives x (or takes the tokens), runs its stage and sends on (the last: the loss / m); B receives
dL/d(output), runs backward and sends dL/dx; W (zero-bubble only) computes the weight gradients. No tags
(a receive takes its peer's next message, NCCL's rule), two channels: activations and gradients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from minipar.collectives import Group, irecv, isend
from minipar.pipeline.schedules import Action, Message, build, messages_of, placement
from minipar.pipeline.timeline import Timeline


def stage_layers(n_layers: int, n_stages: int, counts: tuple[int, ...] | None = None) -> list[list[int]]:
    """Contiguous blocks of layer ids, one per (virtual) stage: balanced, or `counts` layers each (--pp-layers)."""
    if counts is not None and (len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1):
        raise ValueError(f"--pp-layers {','.join(map(str, counts))}: give {n_stages} counts of 1 or more, one per "
                         f"pipeline stage (--pp x chunks per rank), adding up to the model's {n_layers} layers")
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages (--pp x chunks per rank) but the model has {n_layers} "
                         "layers: every stage needs at least one layer")
    base, extra = divmod(n_layers, n_stages)
    sizes = list(counts or [base + (1 if k < extra else 0) for k in range(n_stages)])
    starts = [sum(sizes[:k]) for k in range(n_stages)]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes)]


@lru_cache(maxsize=4096)  # the planner validates hundreds of layouts that share a pipeline
def check_pipeline(schedule: str, pp: int, m: int, virtual: int, n_layers: int, counts: tuple | None = None) -> None:
    """ValueError, one line (ScheduleError: the schedule's), unless pp ranks run m micro-batches, a layer a stage."""
    if pp > 1:
        stage_layers(n_layers, len(placement(schedule, pp, virtual)), counts)  # zbv: two stages a rank
        build(schedule, pp, m, virtual)


@dataclass
class Pipeline:
    """What one rank needs to run its part of a pipeline schedule."""

    group: Group  # the pp group: group rank r runs the stages the schedule places on it
    schedule: str
    n_layers: int
    virtual: int = 1
    grad_group: Group | None = None  # the same ranks, a second channel for gradients (see above)
    seq_shards: int = 1  # tp under sequence parallelism: stages pass on [b, s/tp, d]
    layer_counts: tuple[int, ...] | None = None  # layers per stage (--pp-layers); None: balanced
    timeline: Timeline | None = None  # the last run's measured actions on this rank
    bubble: float = 0.0  # and the fraction of that run this rank spent waiting for its neighbours

    @cached_property
    def placement(self) -> tuple[int, ...]:
        """placement[k]: the pp rank of stage k (the schedule's: looped, or a V for zbv)."""
        return placement(self.schedule, self.group.size, self.virtual)

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    @property
    def my_stages(self) -> list[int]:
        return [k for k, r in enumerate(self.placement) if r == self.group.rank]

    def layers_of(self, stage: int) -> list[int]:
        return stage_layers(self.n_layers, self.n_stages, self.layer_counts)[stage]

    def my_layers(self) -> list[int]:
        return [i for k in self.my_stages for i in self.layers_of(k)]

    def holds_first(self) -> bool:
        return 0 in self.my_stages

    def holds_last(self) -> bool:
        return self.n_stages - 1 in self.my_stages

    def forward_actions(self, n_micro: int) -> list[Action]:
        """Forward only (validation, no gradient): each micro-batch through this rank's stages in
        turn. Every rank walks (micro-batch, stage) in the same order, so each receive meets the
        send its neighbour posted for it, in order, and no rank waits on one that waits on it."""
        return [Action("F", i, k) for i in range(n_micro) for k in self.my_stages]

    # Messages between stages (schedules.messages_of): in memory when local, else on their channel.
    def _channel(self, msg: Message) -> Group:
        return self.group if msg.channel == "pp" else self.grad_group or self.group

    def _receive(self, msg: Message, like: torch.Tensor, local: dict) -> torch.Tensor:
        if msg.local:
            return local.pop(msg)
        irecv(like, self._channel(msg), msg.src_rank).wait()
        return like

    def _send(self, msg: Message, t: torch.Tensor, local: dict, pending: list) -> None:
        if msg.local:
            local[msg] = t.clone()
        else:
            pending.append((isend(t, self._channel(msg), msg.dst_rank), t))

    def run(self, model, micro_batches, divisor: float):
        """A training step's pipeline: this rank's actions on its stages of `model` (see `execute`)."""
        actions = build(self.schedule, self.group.size, len(micro_batches), self.virtual).actions[self.group.rank]
        return self.execute(model, micro_batches, actions, divisor)

    def run_forward(self, model, micro_batches, divisor: float):
        """Its forward actions alone, in the schedule's order (validation: no backward)."""
        return self.execute(model, micro_batches, self.forward_actions(len(micro_batches)), divisor)

    def execute(self, model, micro_batches, actions: list[Action], divisor: float):
        """Run `actions` on this rank's stages of `model`. Returns the step's loss on the last stage,
        0 elsewhere: the sum over micro-batches of (sum of token losses / divisor), the one convention
        of model.cross_entropy (the batch's mean: divisor = its real targets; training: step.py's).
        The measured timeline is left in `self.timeline`."""
        last = self.n_stages - 1
        tokens = micro_batches[0][0]
        act_shape = (tokens.shape[0], tokens.shape[1] // self.seq_shards, model.config.dim)  # [b, s/tp, d]: passed on
        act_dtype = next(model.parameters()).dtype
        split = any(a.kind == "W" for a in actions)
        stage_params = {k: model.stage_parameters(self.layers_of(k), first=k == 0, last=k == last)
                        for k in self.my_stages}
        inputs, outputs, out_grads, local, pending_sends = {}, {}, {}, {}, []
        total, rows, began = 0.0, [], time.perf_counter()
        for a in actions:
            i, k = a.microbatch, a.stage
            incoming, outgoing = messages_of(a, self.placement)
            received = None  # F: the previous stage's output [b, s(/tp), d]; B: the gradient of this one's
            if incoming is not None:
                like = torch.empty(act_shape, dtype=act_dtype, device=tokens.device) if a.kind == "F" else \
                    torch.empty_like(outputs[i, k])  # F: [b, s/tp, d]; B: shaped as this stage's output, the same
                received = self._receive(incoming, like, local)
            start = time.perf_counter()  # the wait for a neighbour is the bubble, not the action's time
            if a.kind == "F":
                x = micro_batches[i][0] if k == 0 else received.requires_grad_()  # tokens [b, s], or [b, s/tp, d]
                out = model.forward_stage(x, self.layers_of(k), first=k == 0, last=k == last,
                                          targets=micro_batches[i][1] if k == last else None, divisor=divisor)
                # out: [b, s/tp, d] for the next stage, or on the last stage the loss, a scalar []
                if k == last:
                    total = total + out.detach()
                inputs[i, k], outputs[i, k], result = x, out, out.detach()
            elif a.kind == "B":
                out, x = outputs[i, k], inputs[i, k]
                if split:  # input gradient only; the weight gradient waits for W
                    result = torch.autograd.grad(out, x, received, retain_graph=True)[0] if k > 0 else None
                    out_grads[i, k] = received
                else:
                    torch.autograd.backward(out, received)  # the last stage's received is None: the loss
                    result = x.grad if k > 0 else None
                    del inputs[i, k], outputs[i, k]  # activations freed
            else:  # W
                torch.autograd.backward(outputs[i, k], out_grads.pop((i, k)), inputs=stage_params[k])
                del inputs[i, k], outputs[i, k]
            rows.append((start, time.perf_counter(), a))  # the action's compute; posting its send is not
            if outgoing is not None:  # F: the output on to the next stage; B: the input's gradient back
                self._send(outgoing, result, local, pending_sends)
        for work, _tensor in pending_sends:
            work.wait()
        self.timeline = Timeline([rows])
        self.bubble = 1.0 - sum(end - start for start, end, _ in rows) / (time.perf_counter() - began)
        return total
