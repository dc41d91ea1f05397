"""Step 8b: how big is the search? minipar's planner beside a per-operator (SOAP) space, counted.

    .venv/bin/python scripts/course/step_08b_search_space.py

(a) minipar's planner (planning/planner.py `layouts`): one layout for the whole model, the same
    dp x tp x pp x cp for every layer, times ZeRO stage and recompute; every candidate is costed.
(b) a FlexFlow-style SOAP space for the same model: each operator with weights picks its own
    degrees along Sample (the batch), Attribute (the sequence) and Parameter (its weight's
    features), whose product divides the GPUs. The count leaves out which GPUs each operator
    uses and the operators without weights, so it is a lower bound. It is a count, not a search:
    nothing here enumerates it.

Chapter: docs/08_memory_and_planning.md.
"""

import math

import torch
from torch import nn

from minipar.model import Llama, RMSNorm, get_config
from minipar.planning.planner import Cluster, layouts

CASES = [("8b", 8, 1024), ("70b", 64, 256)]  # model, GPUs (8 per node), sequences per step; seq 8192


def degree_choices(gpus: int) -> int:
    """Ordered (n_S, n_A, n_P) with n_S * n_A * n_P dividing `gpus`: one operator's choices."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    return sum(1 for a in divisors for b in divisors for c in divisors if gpus % (a * b * c) == 0)


def operators_with_weights(model: str) -> tuple[int, dict[str, int]]:
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        llama = Llama(get_config(model), seed=0)
    kinds = {"linear": nn.Linear, "embedding": nn.Embedding, "norm": RMSNorm}
    counts = {k: sum(isinstance(m, t) for m in llama.modules()) for k, t in kinds.items()}
    return sum(counts.values()), counts


def main() -> None:
    print("(a) minipar's planner: one uniform layout (dp x tp x pp x cp) x ZeRO 0-3 x recompute, every one costed")
    for model, gpus, batch in CASES:
        found = list(layouts(model, Cluster(gpus), seq_len=8192, global_batch=batch))
        meshes = sorted({(c.dp, c.tp, c.pp, c.cp) for c in found})
        print(f"  {model} on {gpus} GPUs, seq 8192, {batch} sequences: {len(found)} candidates: {len(meshes)} "
              "meshes (dp, tp, pp, cp), each with the ZeRO stages and recompute settings minipar's checks allow")
    print("\n(b) a SOAP space: each operator with weights picks (n_S, n_A, n_P), n_S*n_A*n_P dividing the GPUs")
    for model, gpus, _ in CASES:
        n, counts = operators_with_weights(model)
        k = degree_choices(gpus)
        print(f"  {model}: {n} operators ({', '.join(f'{v} {name}' for name, v in counts.items())}); "
              f"{k} choices each on {gpus} GPUs; {k}^{n} = 10^{n * math.log10(k):.1f} strategies")


if __name__ == "__main__":
    main()
