"""Step 11: what each recompute setting keeps and redoes, under the planner's pick for 70B on 64 GPUs.

    .venv/bin/python scripts/course/step_11_selective_recompute.py

For the layout `--tp 2 --pp 8 --cp 4 --sp --zero 1` (bf16 autocast, 2,048 tokens a micro-batch per
rank, 8 micro-batches in flight on pp rank 0) and each recompute setting: what a layer keeps for
backward (estimate.layer_activation_bytes, byte-exact against autograd and torch's selective cache in
tests/test_estimate.py), the matmul FLOPs its replay runs again a token (selective: none, but under
ring attention, one autograd node of its own, the scores), pp rank 0's activations, the fullest rank's
peak, and the planner's clock (planner.step_time: compute, and the step's total). First, a layer's
forward FLOPs a token, by part.

No processes: arithmetic on the 70b preset, on paper.

Chapter: docs/11_capstone.md.
"""

from dataclasses import replace

from minipar.layout import Layout
from minipar.model import get_config
from minipar.planning.estimate import activation_bytes, layer_activation_bytes, peak_bytes, replayed_bytes
from minipar.planning.planner import Cluster, step_time

MODES = {"none": {}, "selective (--recompute-selective)": dict(recompute_selective=True),
         "the MLPs (--recompute-mlp)": dict(recompute_mlp=True), "whole layers (--recompute)": dict(recompute=True)}


def the_pick(c) -> Layout:
    """The planner's pick for 70B on 64 GPUs, before recompute (chapter 11, section 5)."""
    return Layout(model="70b", tp=2, pp=8, cp=4, sp=True, zero=1, seq_len=8192, global_batch=1024, micro_batch=1,
                  dtype="bfloat16", vocab_size=c.vocab_size)


def layer_flops(c) -> dict[str, int]:
    """A layer's forward matmul FLOPs a token at s = 8,192, by part."""
    d, ffn, kv, s = c.dim, c.ffn_dim, c.n_kv_heads * c.head_dim, 8192
    return {"q, k, v, o projections": 2 * (2 * d * d + 2 * d * kv), "attention's scores and sum (q k^T, p v)":
            2 * 2 * d * s, "the MLP (gate, up, down)": 2 * 3 * d * ffn}


def redone_flops(parts: dict[str, int]) -> dict[str, int]:
    """The matmul FLOPs a token each setting's replay runs again (selective: the scores, under ring attention)."""
    return {"none": 0, "selective (--recompute-selective)": parts["attention's scores and sum (q k^T, p v)"],
            "the MLPs (--recompute-mlp)": parts["the MLP (gate, up, down)"], "whole layers (--recompute)":
            sum(parts.values())}


def main() -> None:
    c = get_config("70b")
    pick, parts = the_pick(c), layer_flops(c)
    total = sum(parts.values())
    print(f"70b: a layer's forward at s 8,192, matmul FLOPs a token (the element-wise ops are memory-bound): "
          f"{total / 1e9:.2f} G")
    for name, flops in parts.items():
        print(f"  {name:<42} {flops / 1e9:>5.2f} G  {flops / total:>4.0%}")
    redone = redone_flops(parts)
    print("--tp 2 --pp 8 --cp 4 --sp --zero 1, bf16 autocast, 1,024 sequences of 8,192 a step, 64 H100s:")
    print(f"  {'recompute':<34} {'a layer keeps':>14} {'redone':>8} {'pp rank 0':>10} {'fullest':>9} "
          f"{'compute':>9} {'step':>9}")
    for name, mode in MODES.items():
        cfg = replace(pick, **mode)
        t = step_time(c, cfg, Cluster(64))
        print(f"  {name:<34} {layer_activation_bytes(c, cfg) / 2**20:>10.1f} MiB {redone[name] / 1e9:>6.2f} G "
              f"{activation_bytes(c, cfg) / 2**30:>6.1f} GiB {peak_bytes(c, cfg) / 1e9:>6.1f} GB "
              f"{t['compute']:>7.1f} s {t['total']:>7.1f} s")
    selective = replace(pick, recompute_selective=True)
    print(f"  selective: a layer's replay rebuilds {replayed_bytes(c, selective) / 2**20:.1f} MiB in its backward, "
          f"written and read at HBM's bandwidth by the clock")


if __name__ == "__main__":
    main()
