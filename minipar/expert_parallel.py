"""Expert parallelism: each rank holds some of an MoE layer's experts; tokens reach them by all-to-all.

Chapter 7, part two (part one, the plain MoE layer, is moe.py). The ep ranks are carved out of dp x
cp, not added as a fifth factor of the world (Mesh.unflatten, as torchtitan and Megatron do):

    dp 4, ep 2:   dp group {0 1 2 3}  ->  ep groups {0 1} {2 3}   edp groups {0 2} {1 3}
                  rank 0 holds experts 0..E/2-1, rank 1 the rest; ranks 0 and 2 hold the same ones

One MoE layer, on each rank of an ep group (E experts, E/ep here; the router ran locally):

    1. sort this rank's (token, expert) assignments by expert: one run of tokens per expert
    2. all-to-all the counts per expert: each rank learns how many tokens it will receive
    3. all-to-all the tokens (uneven splits): the runs for experts on rank j go to rank j
    4. regroup what arrived (rank-major) by local expert, run each expert on its tokens
    5. all-to-all the results back (the same splits, swapped), where moe.py puts them back in
       token order and adds each token's k results with its router weights

An expert's gradient is divided by ep here and averaged over edp. Read docs/07_expert_parallel.md:
the bytes, the gradients' mean, and experts under tp, sp and cp.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import nn

from minipar.autograd_ops import all_to_all_with_grad, reduce_from_parallel
from minipar.collectives import Group, all_reduce, all_to_all
from minipar.model import ModelError
from minipar.moe import Experts, MoE
from minipar.placement import Placement, place, placement_of


def expert_parallel_dispatch(x_sorted: torch.Tensor, counts: torch.Tensor, experts: Experts,
                             group: Group) -> torch.Tensor:
    """moe.local_dispatch across ranks: steps 2-5 of the module docstring."""
    ep, local = group.size, len(counts) // group.size
    recv_counts = all_to_all(counts, group)  # [ep * local]: from each rank, its tokens for each expert here
    send = counts.view(ep, local).sum(1).tolist()
    recv = recv_counts.view(ep, local).sum(1).tolist()
    x = all_to_all_with_grad(x_sorted, group, 0, send, recv)  # runs from rank 0, rank 1, ... in order
    expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv_counts)
    by_expert = expert_of_row.argsort(stable=True)
    y = experts(x[by_expert], recv_counts.view(ep, local).sum(0).tolist())
    return all_to_all_with_grad(y[by_expert.argsort()], group, 0, recv, send)


def pool_over(p_sum: torch.Tensor, counts: torch.Tensor, tokens: int, groups: tuple[Group, ...]):
    """The load-balancing loss's sums over the ranks holding the rest of the micro-batch's tokens.
    Forward adds them up; backward leaves each rank the gradient of its own tokens' probabilities."""
    for group in groups:
        p_sum = reduce_from_parallel(p_sum, group)
        all_reduce(counts, group)
        tokens *= group.size
    return p_sum, counts, tokens


def parallelize_experts(model: nn.Module, ep: Group | None, tp: Group | None, cp: Group | None, sp: bool) -> None:
    """Apply expert parallelism (and the MoE side of tp/sp and cp) to every MoE block of `model`."""
    sp_tp = tp if sp and tp is not None and tp.size > 1 else None
    token_groups = tuple(g for g in (sp_tp, cp) if g is not None and g.size > 1)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        if token_groups:
            moe.pool_tokens = partial(pool_over, groups=token_groups)
        moe.aux_replicas = cp.size if cp is not None else 1
        if sp_tp is not None:  # each tp rank routed different tokens: its gradients are part of the sum
            for p in moe.parameters():
                place(p, replace(placement_of(p), partial=("tp",)))
        if ep is not None and ep.size > 1:
            keep_local_experts(moe.experts, ep)
            moe.dispatch = partial(expert_parallel_dispatch, group=ep)


def keep_local_experts(experts: Experts, ep: Group) -> None:
    """Keep this rank's E/ep experts (cut from the full, single-device weights), placed over ep."""
    n = experts.w_gate.shape[0] // ep.size
    for name, p in list(experts.named_parameters()):
        local = nn.Parameter(p.detach()[ep.rank * n : (ep.rank + 1) * n].clone())
        place(local, Placement(tuple(p.shape), shards=(("ep", 0),), partial=placement_of(p).partial,
                               grad_mean=("edp",)))
        local.register_hook(partial(torch.mul, other=1.0 / ep.size))  # the holder sums over ep: see above
        setattr(experts, name, local)


def check_expert_layout(n_experts: int, ep: int, dp_cp: int) -> None:
    """Raises ValueError (one line) for an expert layout that cannot work (ModelError: the model's experts)."""
    if ep > 1 and not n_experts:
        raise ModelError(f"--ep {ep} needs a mixture-of-experts model (e.g. --model tiny-moe or small-moe)")
    if n_experts and n_experts % ep:
        raise ModelError(f"{n_experts} experts do not split over --ep {ep}: choose an ep that divides {n_experts}")
    if dp_cp % ep:
        raise ValueError(f"--ep {ep} must divide dp x cp = {dp_cp}: expert parallelism is carved out of "
                         f"the data-parallel ranks")
