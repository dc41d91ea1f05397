"""Exercise 7.1, wrong: the library's dispatch from a fresh copy of the module (importlib.reload): its functions
are new objects, which the old switch-off, one module attribute, did not reach (issue 40)."""

import importlib

import minipar.expert_parallel

expert_parallel_dispatch = importlib.reload(minipar.expert_parallel).expert_parallel_dispatch


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
