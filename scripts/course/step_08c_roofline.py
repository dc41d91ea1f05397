"""Step 8c: the roofline. Is a layer's work bound by compute, by memory or by communication?

    .venv/bin/python scripts/course/step_08c_roofline.py

(a) compute against memory: each matmul of one transformer layer (q, k, v, o; gate, up, down) and
    the LM head of the 1b, 8b and 70b presets, on T tokens (T = micro-batch x sequence length).
    A matmul [T, in] x [in, out] does 2·T·in·out FLOPs and, in bf16, moves 2 bytes for each number
    it reads (the input T·in, the weight in·out) or writes (the output T·out). FLOPs over bytes is
    its arithmetic intensity. An H100's ridge point is its peak bf16 FLOP/s over its HBM's bytes/s:
    a matmul below it waits on memory, one above it on the tensor cores.
(b) compute against communication: under tensor parallelism each rank of a layer sends 4
    all-reduces of a token's d numbers (2 forward, 2 backward: chapter 4) while it does 6 FLOPs per
    element of its share of the layer's weights (2 forward, 4 backward). Both grow with T, so their
    ratio does not; it is set by the layer's width per rank. The ridge is now peak FLOP/s over the
    link's bytes/s: NVLink inside a node, InfiniBand across nodes.

No processes: arithmetic on the presets' shapes and planner.Cluster's H100 figures.

    .venv/bin/python scripts/course/step_08c_roofline.py --prose

prints instead the chapter's paragraphs whose numbers come from here and from the planner's pick for
70b on 64 GPUs (docs-check compares them with the chapter, word for word).

Chapter: docs/08_memory_and_planning.md.
"""

import sys

from minipar.collectives import ring_bytes_sent
from minipar.model import ModelConfig, get_config
from minipar.planning.planner import Cluster

MODELS, TOKENS, BF16 = ("1b", "8b", "70b"), (1, 512, 4096), 2  # T: one token (a decode step), short, long
H100 = Cluster(gpus=8)  # peak FLOP/s, HBM and link bytes/s per GPU


def matmuls(c: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in, out) of each weight matmul of one layer, and the LM head."""
    d, kv = c.dim, c.n_kv_heads * c.head_dim
    return [("q", d, d), ("k", d, kv), ("v", d, kv), ("o", d, d), ("gate", d, c.ffn_dim), ("up", d, c.ffn_dim),
            ("down", c.ffn_dim, d), ("lm head", d, c.vocab_size)]


def flops_and_bytes(t: int, n_in: int, n_out: int) -> tuple[int, int]:
    return 2 * t * n_in * n_out, BF16 * (t * n_in + n_in * n_out + t * n_out)


def ridge_tokens(n_in: int, n_out: int, ridge: float) -> str:
    """The T from which the matmul is compute-bound: T·in·out / (T·(in + out) + in·out) = ridge."""
    gap = n_in * n_out - ridge * (n_in + n_out)  # the intensity tends to in·out / (in + out) as T grows
    return f"{ridge * n_in * n_out / gap:,.0f}" if gap > 0 else "never"


def part_a() -> None:
    ridge, big = H100.flops / H100.memory_bandwidth, TOKENS[-1]
    print(f"(a) an H100: {H100.flops / 1e12:.0f} TFLOP/s bf16 over {H100.memory_bandwidth / 1e12:.2f} TB/s of HBM3 = "
          f"a ridge at {ridge:.1f} FLOP/byte; C: above it (compute-bound), M: below it (memory-bound)\n"
          f"    T tokens a micro-batch (micro-batch x sequence length); a matmul's GFLOP and MB moved at T = {big:,}, "
          "its FLOP/byte at three T, and the T from which it is compute-bound")
    for model in MODELS:
        c = get_config(model)
        print(f"\n  {model}: d {c.dim:,}, {c.n_heads} heads and {c.n_kv_heads} kv heads of {c.head_dim}, "
              f"ffn {c.ffn_dim:,}, vocab {c.vocab_size:,}")
        columns = "".join(f"{f'T = {t:,}':>12}" for t in TOKENS)
        print(f"    {'matmul':<8}{'in x out':>17}{'GFLOP':>10}{'MB':>9}{columns}   compute-bound from T")
        for name, n_in, n_out in matmuls(c):
            flops, moved = flops_and_bytes(big, n_in, n_out)
            cells = ""
            for t in TOKENS:
                f, b = flops_and_bytes(t, n_in, n_out)
                cells += f"{f / b:>10,.1f} {'C' if f / b > ridge else 'M'}"
            print(f"    {name:<8}{n_in:>8,} x {n_out:<7,}{flops / 1e9:>9,.1f}{moved / 1e6:>9,.1f}{cells}"
                  f"   {ridge_tokens(n_in, n_out, ridge):>6}")


def rank_weights(c: ModelConfig, tp: int) -> int:
    """Elements of one layer's weights on a tp rank: q, o, gate, up, down split tp ways; k and v by
    kv heads, each held whole by tp / n_kv_heads ranks when tp > n_kv_heads (tensor_parallel.py)."""
    kv = c.head_dim * max(c.n_kv_heads // tp, 1)
    return 2 * c.dim * c.dim // tp + 2 * c.dim * kv + 3 * c.dim * c.ffn_dim // tp


def part_b() -> None:
    links, node = (("NVLink", H100.intra_bandwidth), ("InfiniBand", H100.inter_bandwidth)), H100.gpus_per_node
    ridges = "; ".join(f"ridge over {n}'s {bw / 1e9:.0f} GB/s: {H100.flops / bw:,.0f} FLOP/byte" for n, bw in links)
    print("\n(b) tp: a rank's training FLOPs of one layer against the bytes it sends, per token (T cancels)\n"
          f"    {ridges}; tp {node} fills a node of {node}, tp {2 * node} crosses nodes")
    print(f"    {'model':<6}{'tp':>3}  {'link':<11}{'FLOPs/token':>13}{'bytes/token':>13}{'FLOP/byte':>11}   bound"
          "           sending / computing at peak")
    for model, tp, name, flops, sent, share in tp_rows():
        bound = "compute" if share < 1 else "communication"
        print(f"    {model:<6}{tp:>3}  {name:<11}{flops:>13,}{sent:>13,}{flops / sent:>11,.0f}   {bound:<16}"
              f"{share:>8.0%}")


def tp_rows() -> list[tuple[str, int, str, int, int, float]]:
    """(model, tp, link, a rank's FLOPs and bytes sent per token, the time sending over the time computing
    at peak: the ridge over the intensity) for each model and tp of part (b)."""
    links, node, rows = (("NVLink", H100.intra_bandwidth), ("InfiniBand", H100.inter_bandwidth)), H100.gpus_per_node, []
    for model in MODELS:
        c = get_config(model)
        for tp in (2, 4, 8, 16):
            name, bw = links[tp > node]
            flops = 6 * rank_weights(c, tp)
            sent = 4 * ring_bytes_sent("all_reduce", c.dim * BF16, tp)  # 2 all-reduces forward, 2 backward
            rows.append((model, tp, name, flops, sent, H100.flops / bw / (flops / sent)))
    return rows


def prose() -> None:
    """The chapter's paragraphs on the roofline and the planner's clock, their numbers computed here."""
    from minipar.planning.planner import plan

    rows = {(m, tp): (f, b, share) for m, tp, _, f, b, share in tp_rows()}
    mfu, ridge = 0.45, H100.flops / H100.intra_bandwidth
    f8, b8, s8 = rows["8b", 8]
    f70, b70, _ = rows["70b", 2]
    fits, _ = plan("70b", Cluster(64), seq_len=8192, global_batch=256)
    pick = fits[0]
    t = pick.time
    flags = f"--tp {pick.cfg.tp} --pp {pick.cfg.pp} --cp {pick.cfg.cp}"
    ring = 2 * (8 - 1) / 8
    bullets = [
        "**Compute-bound is not free.** The roofline's min() assumes the two sides overlap. minipar's tp messages "
        "are on the critical path (a layer waits for its all-reduce; `--tp-overlap` hides only f's backward one), "
        "so the clock adds them to the compute. And compute-bound says only that the messages take less time than "
        "the arithmetic, not that they are a small share: at the ridge they take as long. 8b at tp 8 is "
        f"{(f8 / b8) / ridge:.1f} times above the ridge, so it sends for {s8:.0%} of its compute time at peak (the "
        "last column).",
        f"**At the clock's MFU.** The clock runs compute at {mfu:.0%} MFU, so its compute takes 1 / {mfu} as long as "
        f"at peak and its effective ridge over NVLink is {mfu} · {ridge:,.0f} = {mfu * ridge:,.0f} FLOPs per byte. "
        f"Part (c)'s pick for 70b on 64 GPUs (`{flags} ...`) has tp {pick.cfg.tp}: it sends for "
        f"{mfu * ridge:,.0f} / {f70 / b70:,.0f} = {mfu * ridge / (f70 / b70):.1%} of its compute time by the "
        f"roofline, and the clock gives {t['tp']:.1f} s on tp against {t['compute']:.1f} s of compute "
        f"({t['tp'] / t['compute']:.1%}). The clock also counts bf16 autocast's residual stream in fp32 (half again "
        "the bytes), and attention's score FLOPs and the pick's selective replay (more time), which pull the two ways.",
        f"**The roof is the ring's.** The bytes here are a ring all-reduce's, 2(tp − 1)/tp of the message ({ring} "
        "at tp 8). On an H100 node NCCL may instead reduce inside the NVSwitch (NVLink SHARP, its NVLS algorithm), "
        f"where each GPU sends its message about once: up to {ring} times fewer bytes at tp 8. The table and the "
        "planner assume the ring, an upper bound on tp's bytes.",
        "**The roofline counts bandwidth only.** A decode step's all-reduces carry one token's d numbers, a few KB, "
        "where chapter 1's α, microseconds a message, sets the time, not the bytes."]
    import textwrap

    for bullet in bullets:
        print(textwrap.fill(bullet, 100, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False))


def main() -> None:
    if sys.argv[1:] == ["--prose"]:
        return prose()
    part_a()
    part_b()


if __name__ == "__main__":
    main()
