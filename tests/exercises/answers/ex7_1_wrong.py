"""Exercise 7.1, wrong: the top-k probabilities used as weights without renormalising them to sum
to 1 (the dispatch itself is right)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ex7_1_reference import _dispatch  # noqa: E402


def expert_parallel_moe(x, router, experts, top_k, group):
    weights, chosen = router(x).softmax(-1).topk(top_k, dim=-1)
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    y = _dispatch(x[order // top_k], flat.bincount(minlength=router.out_features), experts, group)
    return (y[order.argsort()].view(-1, top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)
