"""Exercise 7.1, an answer: the router's top-k, the assignments sorted by expert, the counts and then
the rows by all-to-all to the experts' ranks, the local experts, the results back the same way."""

import torch

from minipar.autograd_ops import all_to_all_with_grad
from minipar.collectives import all_to_all


def expert_parallel_moe(x, router, experts, top_k, group):
    probs = router(x).softmax(-1)  # [T, E]
    weights, chosen = probs.topk(top_k, dim=-1)  # [T, k]
    weights = weights / weights.sum(-1, keepdim=True)
    flat = chosen.flatten()  # [T*k]: assignment a is token a // k
    order = flat.argsort(stable=True)
    counts = flat.bincount(minlength=probs.shape[-1])  # [E]
    y = _dispatch(x[order // top_k], counts, experts, group)  # [T*k, d], in expert order
    y = y[order.argsort()].view(-1, top_k, x.shape[-1])  # back to assignment order
    return (y * weights.unsqueeze(-1)).sum(1)


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
