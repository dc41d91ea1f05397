"""Exercise 7.1, wrong: every rank all-gathers every rank's tokens, runs its own experts on the ones
routed to them, and a reduce-scatter adds the partial outputs up and hands each rank its tokens.
The output and the gradients are right; the traffic is the whole batch both ways, not the
assignments that leave the rank."""

import torch

from minipar.autograd_ops import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel


def expert_parallel_moe(x, router, experts, top_k, group):
    every = gather_from_sequence_parallel(x, group, 0)  # [N*T, d]
    weights, chosen = router(every).softmax(-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    local = experts.w_gate.shape[0]
    first = group.rank * local
    flat = chosen.flatten()
    mine = ((flat >= first) & (flat < first + local)).nonzero().squeeze(1)  # assignments to my experts
    order = mine[(flat[mine] - first).argsort(stable=True)]
    out = experts(every[order // top_k], (flat[order] - first).bincount(minlength=local).tolist())
    partial = torch.zeros(len(flat), x.shape[-1], dtype=x.dtype).index_copy(0, order, out)
    partial = (partial.view(-1, top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)  # [N*T, d]
    return reduce_scatter_to_sequence_parallel(partial, group, 0)
