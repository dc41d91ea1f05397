"""Exercise 7.1, wrong: the routing written out, and the dispatch delegated to the library's own
expert_parallel_dispatch: the checker switches it off."""

from minipar.expert_parallel import expert_parallel_dispatch


def expert_parallel_moe(x, router, experts, top_k, group):
    probs = router(x).softmax(-1)  # [T, E]
    weights, chosen = probs.topk(top_k, dim=-1)  # [T, k]
    weights = weights / weights.sum(-1, keepdim=True)
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    counts = flat.bincount(minlength=probs.shape[-1])
    y = expert_parallel_dispatch(x[order // top_k], counts, experts, group)
    y = y[order.argsort()].view(-1, top_k, x.shape[-1])
    return (y * weights.unsqueeze(-1)).sum(1)
