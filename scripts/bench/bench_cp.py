"""Benchmark: minipar's ring attention at cp = world against attention on the whole sequence on one device.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/bench/bench_cp.py          # a few minutes on 2 CPU cores
    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/bench/bench_cp.py --seq-lens 1024 4096 --json cp.json

PyTorch's own context parallelism (torch.distributed.tensor.experimental.context_parallel) does not
run on CPU, so the peer here is the computation context parallelism replaces: causal attention over
the whole sequence on one device. For each sequence length s, one launch measures, forward + backward
of causal attention in float32 with b = 1 (q [1, h, s, d], k and v [1, h_kv, s, d]):

    ring          minipar's ring_attention, every rank its zigzag share (s/cp tokens), K/V round the ring
    one device:
      minipar     the same ring_attention on a group of one: the same code, the whole sequence
      sdpa        F.scaled_dot_product_attention(is_causal=True), torch's default CPU kernel (flash-style)
      sdpa-math   the same under sdpa_kernel(SDPBackend.MATH): the textbook path, [s, s] probabilities

Every rank runs every variant, at the same time as the other ranks, with one torch thread: so the
one-device variants run under the conditions of the ring (all ranks busy, one core each), and a
step's time is the slowest rank's (an all-reduce of max after each). Variants take turns, in an
order that rotates each repeat, after one warm-up call each; the figure is the median over repeats.

Memory, per rank, two ways:
  saved     bytes of the tensors autograd keeps for backward (saved_tensors_hooks, one count per
            storage): what attention costs in activation memory for the whole training step;
  peak      the rise of the process's peak resident memory (VmHWM, reset through
            /proc/self/clear_refs) during one forward + backward, over what was resident before:
            saved tensors plus the temporaries (scores of a block, gradients). glibc is told
            to return large blocks to the system at once (mallopt) so that freed memory from an
            earlier variant does not hide this one's peak.

Ratios are ring / one-device variant. Before timing, the ring's output and input gradients are
checked against sdpa's share (float32 rounding). Results and their reading: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics

import bench_common as bench
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import repeat
from torch.nn.attention import SDPBackend, sdpa_kernel

from minipar import context_parallel as C
from minipar.collectives import Group
from minipar.mesh import Mesh


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the figures here (rank 0)")
    return p.parse_args()


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


# ---- the variants: each takes (q, k, v) with requires_grad and returns the attention output ----


def one_device_minipar(q, k, v):
    return C.ring_attention(q, k, v, Group.solo("cp"), q.shape[2])


def sdpa(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = (repeat(t, "b h s d -> b (h g) s d", g=g) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(q, k, v)


# ---- measuring ----


def forward_backward(fn, inputs, d_out) -> None:
    for t in inputs:
        t.grad = None
    fn(*inputs).backward(d_out)


def saved_bytes(fn, inputs) -> int:
    """Bytes autograd keeps for backward during fn(*inputs), one count per storage."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_rss_rise(fn, inputs, d_out) -> int:
    """How far the resident set rose above its starting point during one forward + backward, bytes."""
    for t in inputs:
        t.grad = None
    LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (the peak) to the present resident size
    before = _status_kb("VmRSS")
    forward_backward(fn, inputs, d_out)
    return (_status_kb("VmHWM") - before) * 1024


def timed(fn, inputs, d_out, group: Group) -> float:
    """Seconds of one forward + backward on the slowest rank."""
    dt, _ = bench.timed(forward_backward, fn, inputs, d_out, device=CPU)
    return bench.across_ranks(dt, group, CPU).item()


LIBC = ctypes.CDLL("libc.so.6")
M_MMAP_THRESHOLD = -3
CPU = torch.device("cpu")


# ---- one sequence length ----


def make_inputs(s: int, args, g: Group, variants) -> tuple[dict, dict]:
    """q, k, v for every variant (the ring: this rank's zigzag share), and the output gradient."""
    gen = torch.Generator().manual_seed(s)
    full = [torch.randn(1, n, s, args.head_dim, generator=gen) for n in (args.heads, args.kv_heads, args.kv_heads)]
    d_full = torch.randn(1, args.heads, s, args.head_dim, generator=gen)
    inputs = {name: [t.clone().requires_grad_() for t in full] for name in variants}
    inputs["ring"] = [C.split_sequence(t, g, dim=2).requires_grad_() for t in full]  # [1, h, s/cp, d]
    d_out = {name: d_full for name in variants} | {"ring": C.split_sequence(d_full, g, dim=2)}
    return inputs, d_out


def check_against_sdpa(ring, inputs: dict, d_out: dict, g: Group) -> list[float]:
    """The same attention? max |diff| of the ring's output and gradients against sdpa's share of them."""
    ring_out = ring(*inputs["ring"])
    ring_out.backward(d_out["ring"])
    ref_out = sdpa(*inputs["sdpa"])
    ref_out.backward(d_out["sdpa"])
    check = [(ring_out - C.split_sequence(ref_out, g, dim=2)).abs().max().item()]
    check += [(a.grad - C.split_sequence(b.grad, g, dim=2)).abs().max().item()
              for a, b in zip(inputs["ring"], inputs["sdpa"])]
    return bench.across_ranks(check, g, CPU).tolist()


def measure(variants: dict, inputs: dict, d_out: dict, repeats: int, g: Group) -> tuple[dict, torch.Tensor]:
    """({variant: median seconds}, [variant, (saved bytes, peak rise)]), each the largest rank's."""
    saved = {name: saved_bytes(fn, inputs[name]) for name, fn in variants.items()}
    peak = {name: peak_rss_rise(fn, inputs[name], d_out[name]) for name, fn in variants.items()}
    mem = bench.across_ranks([[saved[n], peak[n]] for n in variants], g, CPU)
    times = {name: [] for name in variants}
    for name, fn in variants.items():  # warm-up
        forward_backward(fn, inputs[name], d_out[name])
    order = list(variants)
    for rep in range(repeats):
        for name in order[rep % len(order):] + order[:rep % len(order)]:
            times[name].append(timed(variants[name], inputs[name], d_out[name], g))
    return {n: statistics.median(t) for n, t in times.items()}, mem


def print_row(row: dict, cp: int) -> None:
    t, sv, pk = row["time_s"], row["saved_bytes"], row["peak_rss_rise_bytes"]
    say(f"\ns = {row['s']}: ring vs sdpa, max |diff| of out dq dk dv: "
        + " ".join(f"{d:.1e}" for d in row["max_abs_diff_out_dq_dk_dv"]))
    say(f"  {'':<11}{'fwd+bwd ms':>11}{'ring /':>8}{'saved MiB':>11}{'ring /':>8}{'peak MiB':>10}{'ring /':>8}")
    for n in t:
        ratios = [f"{'':>8}" if n == "ring" else f"{t['ring'] / t[n]:>7.2f}x",
                  f"{'':>8}" if n == "ring" else f"{sv['ring'] / sv[n]:>7.2f}x",
                  f"{'':>8}" if n == "ring" else f"{pk['ring'] / pk[n]:>7.2f}x"]
        label = f"ring cp={cp}" if n == "ring" else n
        say(f"  {label:<11}{t[n] * 1e3:>11.1f}{ratios[0]}{sv[n] / 2**20:>11.2f}{ratios[1]}"
            f"{pk[n] / 2**20:>10.1f}{ratios[2]}")


def one_length(s: int, variants: dict, args, g: Group) -> dict:
    C.check_cp_layout(s, g.size)
    inputs, d_out = make_inputs(s, args, g, variants)
    check = check_against_sdpa(variants["ring"], inputs, d_out, g)
    times, mem = measure(variants, inputs, d_out, args.repeats, g)
    row = {"s": s, "max_abs_diff_out_dq_dk_dv": check, "time_s": times,
           "saved_bytes": {n: int(mem[i, 0]) for i, n in enumerate(variants)},
           "peak_rss_rise_bytes": {n: int(mem[i, 1]) for i, n in enumerate(variants)}}
    print_row(row, g.size)
    return row


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    LIBC.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # large blocks come from mmap and go back on free
    dist.init_process_group("gloo")
    mesh = Mesh.build(cp=dist.get_world_size())
    g = mesh.groups().cp
    cp = g.size
    say(f"ring attention at cp = {cp} vs causal attention of the whole sequence on one device; float32, b = 1, "
        f"{args.heads} heads, {args.kv_heads} kv heads of {args.head_dim}; one thread per rank; "
        f"torch {torch.__version__}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")

    def ring(q, k, v):
        return C.ring_attention(q, k, v, g, q.shape[2] * cp)

    variants = {"ring": ring, "minipar": one_device_minipar, "sdpa": sdpa, "sdpa-math": sdpa_math}
    results = [one_length(s, variants, args, g) for s in args.seq_lens]
    say(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    if dist.get_rank() == 0:
        bench.write_json(args.json, {"cp": cp, "heads": args.heads, "kv_heads": args.kv_heads,
                                     "head_dim": args.head_dim, "results": results})
    bench.finish(mesh)


if __name__ == "__main__":
    main()
