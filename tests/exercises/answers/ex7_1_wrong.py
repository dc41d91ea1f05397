"""Exercise 7.1, wrong: the top-k probabilities used as weights without renormalising them to sum
to 1 (the dispatch itself is right)."""

import torch

from minipar.autograd_ops import all_to_all_with_grad
from minipar.collectives import all_to_all


def _dispatch(rows, counts, experts, group):
    n, local = group.size, len(counts) // group.size
    recv_counts = all_to_all(counts, group)  # [n * local]: from each rank, its rows for each expert here
    send = counts.view(n, local).sum(1).tolist()
    recv = recv_counts.view(n, local).sum(1).tolist()
    arrived = all_to_all_with_grad(rows, group, 0, send, recv)  # rank-major: rank 0's runs, rank 1's, ...
    expert_of_row = torch.arange(local).repeat(n).repeat_interleave(recv_counts)
    by_expert = expert_of_row.argsort(stable=True)
    out = experts(arrived[by_expert], recv_counts.view(n, local).sum(0).tolist())
    return all_to_all_with_grad(out[by_expert.argsort()], group, 0, recv, send)



def expert_parallel_moe(x, router, experts, top_k, group):
    weights, chosen = router(x).softmax(-1).topk(top_k, dim=-1)
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    y = _dispatch(x[order // top_k], flat.bincount(minlength=router.out_features), experts, group)
    return (y[order.argsort()].view(-1, top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)
