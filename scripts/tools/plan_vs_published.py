"""The planner's clock beside published runs: Llama-3 throughput on H100s, torchtitan's and Megatron-Bridge's.

    .venv/bin/python scripts/tools/plan_vs_published.py

Each run's layout is written as a minipar Layout (where the run uses something minipar lacks, a line
says so and the nearest minipar has stands in), timed by the planner's clock (planner.step_time) on
the Cluster's H100 defaults and sized by the estimator (estimate.peak_bytes). Predicted tokens a
second per GPU = global batch x sequence length / step time / GPUs, beside the published figure;
then the ratios between layouts of one source, where the clock's constants cancel. "MFU to match"
is the MFU at which the clock would give the published figure (found by bisection on Cluster.mfu):
above what bf16 matmuls reach, it says the run does something the clock does not count. Where a run
uses Float8 or FP8, the line after sets beside it torchtitan's own measured speed-up of torch.compile
and Float8 over plain FSDP (its Table 1, Llama-3.1-8B on 8 H100s: 8,532 / 5,762 tokens a second),
an explanation of the miss with the source's own figure, not a change to the clock. Likewise where a run
checkpoints selectively by operator (torchtitan's 8B), a line after costs what --recompute-selective does
not: torchtitan's policy, in the code of its runs' date, counts the aten.mm calls of each block's forward
and keeps the output of the odd-numbered ones (and attention's), so backward redoes the even-numbered:
of a block's q, k, v, o, gate, up and down, the k, o and up matmuls, 2 FLOPs a weight and token, added
to the clock's step at its MFU.
Sources, settings and dates: docs/references.md (chapter 8). No processes: arithmetic only.

Chapter: docs/08_memory_and_planning.md ("The clock against published runs").
"""

from dataclasses import dataclass, replace

from minipar.layout import Layout
from minipar.model import ModelConfig, get_config
from minipar.planning.estimate import peak_bytes
from minipar.planning.planner import Choice, Cluster, step_time


@dataclass(frozen=True)
class Run:
    name: str
    gpus: int
    cfg: Layout
    published: float  # tokens a second per GPU
    memory: float | None  # GiB on the fullest GPU, where published
    nearest: str  # what the run does that minipar cannot, and what stands in
    lacks_speedup: float = 1.0  # measured speed-up of what minipar lacks (FP8, compile), where it applies
    every_other_mm: bool = False  # torchtitan's per-operator checkpointing: backward redoes every second matmul


FLOAT8 = 8532 / 5762  # torchtitan's Table 1: FSDP + torch.compile + Float8 against FSDP, 8B on 8 H100s
TITAN = dict(seq_len=8192, precision="bf16-mixed")  # torchtitan: bf16 compute, fp32 states: minipar's bf16-mixed
# 405B, 512 GPUs: FSDP 8 x TP 8 x PP 8, local batch 32 in torchtitan's default pp micro-batches (pp's 8, of 4).
TITAN_405B = Layout(model="405b", dp=8, tp=8, pp=8, sp=True, zero=2, recompute=True, global_batch=256,
                    micro_batch=4, **TITAN)
TITAN_405B_NOTE = ("Float8 linears, torch.compile and async TP: minipar runs bf16 eagerly and counts tp as exposed; "
                   "FSDP under pp keeps each stage's gathered weights all step: --zero 2")
RUNS = [
    Run("torchtitan 8B, FSDP 8", 8, Layout(model="8b", dp=8, zero=3, recompute_selective=True, global_batch=16,
                                             micro_batch=2, **TITAN), 5762, 82.4,
        "selective activation checkpointing per operator keeps every other matmul's output; "
        "--recompute-selective keeps all of them", every_other_mm=True),
    Run("torchtitan 8B, FSDP 128", 128, Layout(model="8b", dp=128, zero=3, recompute_selective=True, global_batch=256,
                                                 micro_batch=2, **TITAN), 5605, 67.0,
        "the same: --recompute-selective", every_other_mm=True),
    Run("torchtitan 405B, 1F1B", 512, TITAN_405B, 100, 82.5, TITAN_405B_NOTE, FLOAT8),
    Run("torchtitan 405B, interleaved", 512, replace(TITAN_405B, schedule="interleaved", virtual_stages=2), 128,
        72.7, "the same; 2 stages a rank (torchtitan's default for looped schedules)", FLOAT8),
    Run("Megatron-Bridge 70B, VP 5", 64, Layout(model="70b", dp=2, tp=4, pp=8, sp=True, zero=1,
                                                 schedule="interleaved", virtual_stages=5, seq_len=8192,
                                                 global_batch=128, micro_batch=1, precision="bf16-mixed"), 1602, None,
        "FP8 linears (current scaling) and tp's messages overlapped with compute: minipar runs bf16, tp exposed",
        FLOAT8),
]
PAIRS = [("torchtitan 8B, FSDP 8", "torchtitan 8B, FSDP 128"),  # (the faster, the slower) of one source
         ("torchtitan 405B, interleaved", "torchtitan 405B, 1F1B")]


def block_matmuls(c: ModelConfig) -> list[tuple[str, int]]:
    """(name, weights) of each matmul of a (dense) block, in the order its forward calls them."""
    d, kv, ffn = c.dim, c.n_kv_heads * c.head_dim, c.ffn_dim
    return [("q", d * d), ("k", d * kv), ("v", d * kv), ("o", d * d), ("gate", d * ffn), ("up", d * ffn),
            ("down", ffn * d)]


def redone_matmul_flops(c: ModelConfig) -> float:
    """FLOPs a token that backward adds redoing every second matmul of each block (the 2nd, 4th, ...):
    2 a weight, as forward's share of flops_per_token's 6. The output head is outside the blocks."""
    return 2 * c.n_layers * sum(weights for _, weights in block_matmuls(c)[1::2])


def tokens_per_gpu(run: Run, cluster: Cluster) -> float:
    step = step_time(get_config(run.cfg.model), run.cfg, cluster)["total"]
    return run.cfg.global_batch * run.cfg.seq_len / step / run.gpus


def mfu_to_match(run: Run) -> float:
    """The MFU at which the clock's tokens a second equal the published: they grow with the MFU."""
    low, high = 0.01, 4.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if tokens_per_gpu(run, Cluster(run.gpus, mfu=mid)) < run.published else (low, mid)
    return (low + high) / 2


def layout_line(cfg: Layout) -> str:
    return (f"{Choice(cfg, None, 0).flags()} --micro-batch {cfg.micro_batch} --global-batch {cfg.global_batch} "
            f"--seq-len {cfg.seq_len} --precision {cfg.precision}")


def describe(run: Run) -> dict:
    """The run's lines: minipar's layout, what stands in, the clock's step by part, the figures."""
    run.cfg.validate(run.gpus)
    cluster, c = Cluster(run.gpus), get_config(run.cfg.model)
    t, tokens = step_time(c, run.cfg, cluster), tokens_per_gpu(run, cluster)
    row = dict(predicted=tokens, mfu=mfu_to_match(run), memory=peak_bytes(c, run.cfg) / 2**30)
    print(f"\n{run.name} on {run.gpus} H100s\n  minipar's layout: {layout_line(run.cfg)}\n"
          f"  lacks, and stands in: {run.nearest}\n"
          f"  the clock's step: compute {t['compute']:.2f} + tp {t['tp']:.2f} + cp {t['cp']:.2f} + pp "
          f"{t['pp']:.2f} + dp {t['dp']:.2f} + bubble {t['bubble']:.2f} seconds\n"
          f"  tokens a second per GPU: predicted {tokens:,.0f}, published {run.published:,.0f}, "
          f"predicted / published {tokens / run.published:.2f}; MFU to match {row['mfu']:.0%}")
    if run.lacks_speedup > 1:
        adjusted = tokens * run.lacks_speedup
        print(f"  times torchtitan's measured {run.lacks_speedup:.2f}x for compile + Float8: {adjusted:,.0f}, "
              f"predicted / published {adjusted / run.published:.2f}")
    if run.every_other_mm:
        print(redone_line(run, c, cluster, t["total"]))
    print(f"  fits an 80 GB H100 less 10% headroom: {'yes' if row['memory'] * 2**30 <= cluster.usable else 'no'}")
    return row


def redone_line(run: Run, c: ModelConfig, cluster: Cluster, step: float) -> str:
    """The clock's step with torchtitan's per-operator policy costed: its redone matmuls at the clock's MFU."""
    redone, names = redone_matmul_flops(c), ", ".join(name for name, _ in block_matmuls(c)[1::2])
    blocks = 2 * c.n_layers * sum(weights for _, weights in block_matmuls(c))  # the blocks' forward matmuls
    tokens = run.cfg.global_batch * run.cfg.seq_len
    extra = tokens * redone / (cluster.gpus * cluster.flops * cluster.mfu)
    adjusted = tokens / (step + extra) / run.gpus
    return (f"  with torchtitan's policy, backward redoing every second matmul of a block ({names}): "
            f"2 x {c.n_layers} layers x (d kv + d^2 + d ffn) = {redone / 1e9:.2f} GFLOP a token, "
            f"{redone / blocks:.1%} of the blocks' {blocks / 1e9:.2f} forward, + {extra:.2f} seconds at MFU "
            f"{cluster.mfu:.0%}: {adjusted:,.0f}, predicted / published {adjusted / run.published:.2f}")


def main() -> None:
    h100 = Cluster(gpus=8)
    print(f"The planner's clock (planner.step_time) on H100s, the Cluster's defaults: {h100.flops / 1e12:.0f} TFLOP/s "
          f"dense bf16 a GPU at MFU {h100.mfu:.0%}, {h100.gpus_per_node} GPUs a node, NVLink "
          f"{h100.intra_bandwidth / 1e9:.0f} GB/s and InfiniBand {h100.inter_bandwidth / 1e9:.0f} GB/s a GPU; "
          "no latency term; one MFU for every layout")
    rows = {run.name: describe(run) for run in RUNS}
    print(f"\n{'tokens a second per GPU':<31}{'GPUs':>6}{'predicted':>11}{'published':>11}{'ratio':>7}"
          f"{'MFU to match':>14}   GiB: predicted, published   (goal: ratio 0.70 to 1.30)")
    for run in RUNS:
        row = rows[run.name]
        print(f"{run.name:<31}{run.gpus:>6}{row['predicted']:>11,.0f}{run.published:>11,.0f}"
              f"{row['predicted'] / run.published:>7.2f}{row['mfu']:>14.0%}   {row['memory']:>9.1f}, "
              + (f"{run.memory:.1f}" if run.memory else "not given"))
    print("\nBetween layouts of one source (the clock's MFU and bandwidths cancel; goal: within 15%):")
    for faster, slower in PAIRS:
        ours = rows[faster]["predicted"] / rows[slower]["predicted"]
        theirs = next(r.published for r in RUNS if r.name == faster) / next(
            r.published for r in RUNS if r.name == slower)
        print(f"  {faster} / {slower.split(', ')[1]}: predicted {ours:.3f}x, published {theirs:.3f}x, "
              f"off by {ours / theirs - 1:+.1%}")
    pp, v, ratio = TITAN_405B.pp, 2, 128 / 100
    implied = (pp - 1) * (1 - ratio / v) / (ratio - 1)  # (1 + x) = ratio (1 + x / v), x = (pp - 1) / m
    print(f"  1F1B's bubble ratio (pp - 1) / m = {pp - 1}/{TITAN_405B.accum_steps}, interleaved's (pp - 1) / (v m) = "
          f"{pp - 1}/{v * TITAN_405B.accum_steps}: where the bubble is all that differs, the published {ratio:.2f}x "
          f"is what m = {implied:.1f} micro-batches would give")


if __name__ == "__main__":
    main()
