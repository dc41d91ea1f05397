"""Exercise 7.1, a plausible wrong answer: the top-k probabilities used as weights without
renormalising them to sum to 1."""

from minipar.expert_parallel import expert_parallel_dispatch


def expert_parallel_moe(x, router, experts, top_k, group):
    weights, chosen = router(x).softmax(-1).topk(top_k, dim=-1)
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    y = expert_parallel_dispatch(x[order // top_k], flat.bincount(minlength=router.out_features), experts, group)
    return (y[order.argsort()].view(-1, top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)
