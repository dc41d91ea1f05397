"""Step 8d: Korthikanti et al.'s count of what a GPT layer keeps for backward, measured.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/course/step_08d_korthikanti.py

Korthikanti et al. (2022, section 4.1 and table 2) count sbh(34 + 5as/h) bytes per GPT layer in 16-bit
(s tokens, b sequences, h hidden, a heads), and how tensor parallelism, sequence parallelism and
selective or full recompute divide it. Their layer is written here: bf16, LayerNorm, fused QKV, a GELU
MLP of 4h, dropout on the attention probabilities and after each block with 1-byte masks (as PyTorch's
fused dropout keeps on a GPU), no causal mask (the paper counts none), built from minipar's
ColumnParallelLinear and RowParallelLinear on the tp group. Saved-tensor hooks add up the distinct
storages autograd keeps during one forward (the weights not counted), in units of sbh bytes, beside the
paper's formula. Two differences are named in the output: the paper leaves out each LayerNorm's mean
and 1/std per token, and under sp minipar's column-parallel layers keep their all-gathered input.

Every case runs on both ranks (tp = 1 as two groups of one); rank 0 prints, and says whether rank 1
measured the same. tests/test_estimate.py asserts the same equalities on this layer.

Chapter: docs/08_memory_and_planning.md ("Activations: what backward needs").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import finish, say, start_gloo, to_rank0
from torch.utils.checkpoint import checkpoint

from minipar.collectives import Group
from minipar.mesh import Mesh
from minipar.tensor_parallel import ColumnParallelLinear, RowParallelLinear

GPT_SHAPE = (32, 2, 64, 4)  # s, b, h, a: 5as/h = 10, next to the 34
DROPOUT = 0.1
# (the paper's row, tp, sp, recompute): table 2's cases, "selective" the attention core checkpointed
CASES = [("no parallelism: 34 + 5as/h", 1, False, None),
         ("tensor parallel: 10 + 24/t + 5as/(ht)", 2, False, None),
         ("tp + sequence parallel: (34 + 5as/h)/t", 2, True, None),
         ("tp + selective recompute: 10 + 24/t", 2, False, "selective"),
         ("tp + sp + selective recompute: 34/t", 2, True, "selective"),
         ("full recompute: 2", 1, False, "full")]


def paper_sbh(tp: int, sp: bool, recompute: str | None) -> float:
    """Table 2's bytes per layer, in units of sbh."""
    s, _, h, a = GPT_SHAPE
    t, scores = tp, 5 * a * s / h
    if recompute == "full":
        return 2
    if recompute == "selective":
        return 34 / t if sp else 10 + 24 / t
    return (34 + scores) / t if sp else 10 + 24 / t + scores / t


def unlisted_sbh(tp: int, sp: bool, recompute: str | None) -> tuple[float, float]:
    """What the paper leaves out, in units of sbh: the two LayerNorms' mean and 1/std, bf16 each, a token
    (/t under sp); and, under sp, the gathered [b, s, h] inputs of QKV and of the MLP that minipar's
    column-parallel layers keep where Megatron keeps the rank's [b, s/t, h]: 2 bytes x (1 - 1/t) each."""
    h = GPT_SHAPE[2]
    norms = 0 if recompute == "full" else 2 * 2 * 2 / h / (tp if sp else 1)
    return norms, 2 * 2 * (1 - 1 / tp) if sp else 0.0


def saved_bytes(fn, x, skip: set) -> int:
    """Bytes of the distinct storages autograd saves while fn(x) runs, those in `skip` not counted."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(n for ptr, n in storages.items() if ptr not in skip)


def gpt_layer_saves(group: Group, sp: bool, recompute: str | None) -> int:
    """Bytes autograd keeps for one forward of the GPT layer on this rank, tensor-parallel over `group`."""
    s, b, h, a = GPT_SHAPE
    d, tp = h // a, group.size

    def dropout(x):  # a 1-byte mask, as PyTorch's fused dropout keeps on a GPU (F.dropout on CPU: 2 bytes)
        return torch.native_dropout(x, DROPOUT, True)[0]

    def attention_core(q, k, v):  # [b a/t, s, d] each
        probs = dropout(torch.softmax(torch.bmm(q, k.transpose(1, 2)) / d**0.5, dim=-1))  # [b a/t, s, s]
        return torch.bmm(probs, v)

    norm1, norm2 = torch.nn.LayerNorm(h, dtype=torch.bfloat16), torch.nn.LayerNorm(h, dtype=torch.bfloat16)
    qkv_proj, fc1 = (ColumnParallelLinear(h, n * h, group, bias=True, sequence_parallel=sp) for n in (3, 4))
    out_proj, fc2 = (RowParallelLinear(n * h, h, group, bias=True, sequence_parallel=sp) for n in (1, 4))
    for linear in (qkv_proj, fc1, out_proj, fc2):
        torch.nn.init.normal_(linear.weight, std=0.02)
        linear.to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr()
               for m in (norm1, norm2, qkv_proj, fc1, out_proj, fc2) for p in m.parameters()}

    def layer(x):  # [b, s (/t under sp), h]
        qkv = qkv_proj(norm1(x))  # [b, s, 3h/t]
        q, k, v = (t.transpose(1, 2).reshape(-1, s, d) for t in qkv.view(b, s, -1, 3 * d).split(d, dim=-1))
        core = checkpoint(attention_core, q, k, v, use_reentrant=True) if recompute == "selective" \
            else attention_core(q, k, v)  # [b a/t, s, d]
        x = x + dropout(out_proj(core.view(b, -1, s, d).transpose(1, 2).reshape(b, s, -1)))
        return x + dropout(fc2(F.gelu(fc1(norm2(x)))))

    x = torch.randn(b, s // tp if sp else s, h, dtype=torch.bfloat16, requires_grad=True)
    whole = (lambda x: checkpoint(layer, x, use_reentrant=True)) if recompute == "full" else layer
    return saved_bytes(whole, x, weights)


def main() -> None:
    start_gloo()
    if dist.get_world_size() != 2:
        raise SystemExit("step_08d_korthikanti.py runs on 2 ranks: torchrun --standalone --nproc-per-node 2 ...")
    s, b, h, a = GPT_SHAPE
    torch.manual_seed(0)
    meshes = {1: Mesh.build(dp=2), 2: Mesh.build(tp=2)}  # tp groups of one rank each, and of both
    say(f"Korthikanti et al.'s GPT layer at s = {s}, b = {b}, h = {h}, a = {a}, bf16: the bytes autograd keeps "
        "for backward, in units of sbh")
    say(f"{'table 2 (t = 2 where there is tp)':<42}{'paper':>8}{'measured':>10}   measured - paper = "
        "LayerNorm statistics + gathered inputs")
    for row, tp, sp, recompute in CASES:
        measured = to_rank0(gpt_layer_saves(meshes[tp].groups().tp, sp, recompute) / (s * b * h))
        if measured is not None:
            paper, (norms, gathered) = paper_sbh(tp, sp, recompute), unlisted_sbh(tp, sp, recompute)
            print(f"{row:<42}{paper:>8g}{measured[0]:>10g}   {measured[0] - paper:g} = {norms:g} + {gathered:g}"
                  + ("" if measured[0] == paper + norms + gathered else "  (not that sum!)")
                  + ("" if measured[1] == measured[0] else "  (rank 1 measured otherwise)"))
    say(f"5as/h = {5 * a * s / h:g}; the LayerNorms' statistics: 2 norms x 2 numbers x 2 bytes a token = 8/h = "
        f"{8 / h:g} sbh, /t under sp; under sp the gathered inputs of QKV and of the MLP: 2 bytes x (1 - 1/t) "
        "each, 2 sbh at t = 2; rank 1 measured what rank 0 did unless a row says otherwise")
    meshes[1].destroy()
    finish(meshes[2])


if __name__ == "__main__":
    main()
