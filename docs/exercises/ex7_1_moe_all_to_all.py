"""Exercise 7.1 (chapter 7, "Experts, routing, top-k" and "Dispatch: five steps"), implement: top-k
routing with all-to-all.

Every rank holds the whole router (E experts' scores) and E/N of the experts (rank r: experts
r*E/N .. (r+1)*E/N - 1, in `experts`, an minipar.moe.Experts), and its own T tokens x [T, d].
Return y [T, d], what the plain single-device MoE layer (minipar/moe.py, softmax router, every
token kept, no shared expert) gives for these tokens:

  1. probs = softmax(router(x)); the top_k experts of each token and their probabilities,
     renormalised to sum to 1 (the token's weights);
  2. sort the T*top_k (token, expert) assignments by expert: each expert's tokens are one run;
  3. send each run to the rank holding its expert: all-to-all the counts per expert first, so each
     rank knows how many rows it will receive, then the rows (uneven splits);
  4. run each local expert on its rows: `experts(rows_grouped_by_expert, counts_per_local_expert)`;
  5. send the results back (the same all-to-all, splits swapped), undo the sort, and add each
     token's top_k results with its weights.

Autograd must flow: use `all_to_all_with_grad(t, group, 0, send_splits, recv_splits)` from
minipar/autograd_ops.py for rows that carry gradients (plain `all_to_all` from
minipar/collectives.py for the counts). The checker compares y, x's gradient, the router's
gradient (summed over ranks) and each local expert's gradient with one device's, on 2 and 4
ranks of 8 experts, top-2.

What the checker reads: the ledger on `group` must show, forward, the all-to-all of the counts
(a few bytes), the one of this rank's T*top_k rows and the one of the rows it received (sent
back); backward, the same two reversed. The library's `expert_parallel_dispatch`,
`parallelize_experts` and `MoE` are switched off.

The library's own, after you tried: `MoE.forward` in minipar/moe.py and
`expert_parallel_dispatch` in minipar/expert_parallel.py.

Check: make exercise N=7.1 (2 and 4 ranks, a few seconds)
"""

import torch
from torch import nn

from minipar.autograd_ops import all_to_all_with_grad  # noqa: F401 - yours to use
from minipar.collectives import Group, all_to_all  # noqa: F401 - yours to use
from minipar.moe import Experts


def expert_parallel_moe(x: torch.Tensor, router: nn.Linear, experts: Experts, top_k: int,
                        group: Group) -> torch.Tensor:
    """y [T, d] for this rank's tokens x [T, d]: top-k routing, experts reached by all-to-all."""
    raise NotImplementedError("hint: flat = chosen.flatten(); order = flat.argsort(stable=True); "
                              "counts = torch.bincount(flat, minlength=E); the rows x[order // top_k]")
