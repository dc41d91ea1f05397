"""The course's pictures, drawn from the library's own numbers (the chapters show docs/img/*.png).

    .venv/bin/python scripts/tools/draw_figures.py                              # all sixteen, into runs/figures
    .venv/bin/python scripts/tools/draw_figures.py zero tp --out /tmp/figures   # some of them, elsewhere

--out is a new folder (one that holds anything is refused, docs/img included: nothing is drawn
over); copy the PNGs into docs/img/ to update the course's. The loss runs (parity, muon-loss) take
a few minutes.

    memory    one device's bytes by kind (weights, gradients, AdamW, activations) for 1b, 8b and 70b,
              bf16-mixed, one 4,096-token sequence (planning/estimate: held_bytes, activation_bytes),
              against an H100's 80 GB                                                    chapter 0
    ring      the bytes each rank sends per byte of payload for all-reduce, all-gather and reduce-
              scatter as N grows (collectives.ring_bytes_sent): 2(N-1)/N and (N-1)/N      chapter 1
    buckets   DataParallel's gradient buckets of the small model (float32, 1 MiB, in backward order:
              data_parallel.bucket_params) and each one's all-reduce bytes per rank at dp 4 chapter 2
    zero      who holds what under ZeRO 0-3 at dp 4, at the end of backward and after the gradients'
              reduce-scatter (planning/estimate.held_bytes: equal to what the ranks hold,
              tests/test_mixed_precision.py)                                               chapter 3
    tp        the column/row split of the MLP at tp 2 (the shard shapes parallelize cuts)   chapter 4
    muon      the singular values of a momentum-like matrix (a spectrum from 1 down to 1e-3) before and
              after 1, 3 and 5 Newton-Schulz steps (muon.newton_schulz): those above a tenth of the
              largest end near [0.7, 1.2], the tiny ones lifted least                    chapter 4c
    zigzag    which cp rank holds each query row of causal attention, contiguous against zigzag
              (context_parallel.zigzag_positions), and the work each rank does          chapter 5
    experts   the tokens each ep rank sends each other in one MoE layer's all-to-all (the router
              of the small-moe model on random tokens)                                   chapter 7
    layouts   every layout the planner weighs for 8b on 8 H100s (seq 8,192, 1,024 sequences a step):
              its fullest rank's bytes (estimate.peak_bytes) against its step time (planner.step_time),
              those that fit in 80 GB less 10% headroom marked, the pick circled          chapter 8
    parity    the same training run under six layouts (scripts/train.py, float64): one curve, and
              each layout's largest difference from one process                         chapter 9
    zeropp    ZeRO++'s two hops: the bytes one rank sends per micro-batch for one ZeRO-3 unit of 8b
              at dp 16 on 2 nodes, inside its node and across nodes, plain and with qwz, hpz, qgz
              (planning/estimate_zeropp.bucket_messages)                                 chapter 3c
    roofline  attainable FLOP/s against FLOPs per byte on an H100 (planner.Cluster): HBM's roof with
              8b's matmuls at three token counts, and the NVLink and InfiniBand roofs with tp's
              FLOPs per byte sent (scripts/course/step_08c_roofline.py's arithmetic)      chapter 8
    mesh      the 16 ranks of chapter 9's pp 2 x dp 2 x cp 2 x tp 2 on two nodes of 8 (mesh.MeshLayout):
              which ranks share a node, and each kind of group                          chapter 9
    commit    the commit protocol's timeline: two replica groups, group 1 killed, the survivor's
              stall and redone step, its steps alone (R / P as long), group 1's restart, heal and
              rejoin (commit_timeline: the protocol of extras/replicas.py, in step units) chapter 10b
    muon-loss the training loss of make train's run (small model, the standard library's source) on one
              process for 300 steps, under AdamW and under --optimizer muon, against the tokens seen
              (scripts/train.py --log-json, both runs at once)                            chapter 4c
    recompute what a 70b layer keeps for backward under each recompute setting, and pp rank 0's
              activations at their peak, for chapter 11's pick (estimate.layer_activation_bytes,
              replayed_bytes, activation_bytes; step_11_selective_recompute.py's layout)  chapter 11
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from minipar.collectives import ring_bytes_sent  # noqa: E402
from minipar.context_parallel import zigzag_positions  # noqa: E402
from minipar.data_parallel import bucket_params, by_grad_mean  # noqa: E402
from minipar.model import Llama, get_config  # noqa: E402
from minipar.moe import MoE  # noqa: E402
from minipar.muon import newton_schulz  # noqa: E402
from minipar.ops.args import new_folder, refusals, unoccupied  # noqa: E402
from minipar.planning.estimate import activation_bytes, held_bytes, layer_activation_bytes, replayed_bytes  # noqa: E402
from minipar.planning.planner import Cluster, step_time, weigh  # noqa: E402
from minipar.run.config import TrainConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]  # one per rank


def zero_held(stage: int) -> dict[str, dict[str, int]]:
    """What each of 4 dp ranks holds under `stage` (small model, bf16-mixed), in bytes by kind, at the
    two moments of a step: the end of backward, and after the gradients' reduce-scatter (the step).
    They differ only at stage 1, which the paper defines by the first: its optimizer state is sharded
    but every rank still holds every gradient (P_os). minipar's stage 1 accumulates whole .grad
    tensors during backward and keeps only its slice once they are reduce-scattered."""
    c = get_config("small")
    after = held_bytes(c, TrainConfig(model="small", dp=4, zero=stage, precision="bf16-mixed"))
    if stage != 1:
        return {"end of backward": after, "after reduce-scatter": after}
    whole = held_bytes(c, TrainConfig(model="small", dp=1, precision="bf16-mixed"))["grads"]  # every bf16 grad
    return {"end of backward": {**after, "grads": whole}, "after reduce-scatter": after}


def zero(out: Path) -> None:
    kinds = ("params", "grads", "optimizer")
    labels = ("weights (bf16) + fp32 masters", "gradients (bf16)", "AdamW momentum, variance (fp32)")
    held = [zero_held(stage) for stage in range(4)]
    fig, ax = plt.subplots(figsize=(7.6, 4.8))
    for m, (moment, hatch) in enumerate((("end of backward", ""), ("after reduce-scatter", "//"))):
        x = [stage + (m - 0.5) * 0.4 for stage in range(4)]
        bottom = [0.0] * 4
        for kind, label, color in zip(kinds, labels, COLORS):
            mib = [h[moment][kind] / 2**20 for h in held]
            ax.bar(x, mib, width=0.38, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                   label=label if m == 0 else None)
            bottom = [b + v for b, v in zip(bottom, mib)]
        for xi, total in zip(x, bottom):
            ax.text(xi, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.bar([0], [0], color="white", edgecolor="grey", hatch="//", label="hatched: after the reduce-scatter")
    ax.set_xticks(range(4), ["no ZeRO", "stage 1\n(optimizer)", "stage 2\n(+ gradients)", "stage 3\n(+ weights)"])
    fig.text(0.01, 0.01, "Left bar of each pair: the end of backward; right (hatched): after the gradients' "
             "reduce-scatter, at the step.\nStage 1 still holds every gradient at the end of backward (the paper's "
             "P_os); stage 2 never does.\nNo ZeRO: the gradients' bar includes DataParallel's flat all-reduce "
             "buffers (2 Psi).", fontsize=7)
    ax.set_ylabel("MiB held by each of 4 dp ranks")
    ax.set_title("small model in bf16-mixed, dp 4: (2 + 2 + 12) Psi, split stage by stage")
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(out / "03_zero_stages.png", dpi=110)


def _matrix(ax, x, y, w, h, parts, vertical, label):
    """A w x h matrix at (x, y) cut into `parts` colored slices: columns if vertical, else rows."""
    for r in range(parts):
        if parts == 1:  # whole, the same on every rank
            ax.add_patch(Rectangle((x, y), w, h, color="lightgray"))
        elif vertical:
            ax.add_patch(Rectangle((x + r * w / parts, y), w / parts, h, color=COLORS[r], alpha=0.75))
        else:
            ax.add_patch(Rectangle((x, y + h - (r + 1) * h / parts), w, h / parts, color=COLORS[r], alpha=0.75))
    ax.add_patch(Rectangle((x, y), w, h, fill=False, linewidth=1.2))
    ax.text(x + w / 2, y - 0.35, label, ha="center", va="top", fontsize=8)


def tp(out: Path) -> None:
    c, t = get_config("small"), 2
    d, f = c.dim, c.ffn_dim
    fig, ax = plt.subplots(figsize=(9, 3.6))
    _matrix(ax, 0, 1, 1.2, 2, 1, True, f"X [tokens, {d}]\nwhole on every rank")
    ax.text(1.7, 2.35, "f", fontsize=13, ha="center", style="italic")
    ax.text(1.7, 1.75, "×", fontsize=14, ha="center")
    _matrix(ax, 2.2, 1, 2.4, 2, t, True, f"W_gate, W_up: columns cut\n[{d}, {f}] -> [{d}, {f // t}] a rank")
    ax.text(5.0, 2, "=", fontsize=14, ha="center")
    _matrix(ax, 5.4, 1, 2.4, 2, t, True, f"H = silu(X W_gate) * X W_up\n[tokens, {f // t}] a rank, no message")
    ax.text(8.05, 2, "×", fontsize=14, ha="center")
    _matrix(ax, 8.3, 0.4, 1.2, 3.2, t, False, f"W_down: rows cut\n[{f}, {d}] -> [{f // t}, {d}] a rank")
    ax.text(9.9, 2.35, "g", fontsize=13, ha="center", style="italic")
    ax.text(9.9, 1.75, "=", fontsize=14, ha="center")
    _matrix(ax, 10.3, 1, 1.2, 2, 1, True, "Y = sum of the partial\nproducts (g: all-reduce)")
    ax.set_xlim(-0.3, 11.8)
    ax.set_ylim(-0.8, 4)
    ax.axis("off")
    ax.set_title(f"Tensor parallelism at tp {t}: the MLP's column-then-row split (colors: ranks)")
    fig.tight_layout()
    fig.savefig(out / "04_tp_column_row.png", dpi=110)


def zigzag(out: Path) -> None:
    cp, s = 4, 16
    owners = {"contiguous": [p // (s // cp) for p in range(s)], "zigzag": [0] * s}
    for r in range(cp):
        for p in zigzag_positions(r, cp, s).tolist():
            owners["zigzag"][p] = r
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.4))
    for ax, (name, owner) in zip(axes, owners.items()):
        work = [sum(q + 1 for q in range(s) if owner[q] == r) for r in range(cp)]  # keys each rank's queries see
        for q in range(s):
            for k in range(q + 1):
                ax.add_patch(Rectangle((k, s - 1 - q), 1, 1, color=COLORS[owner[q]], alpha=0.8))
        ax.set_xlim(0, s)
        ax.set_ylim(0, s)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("key position 0 .. 15")
        ax.set_ylabel("query position (0 at top)")
        ax.set_title(f"{name}: score blocks per rank {work}", fontsize=10)
    fig.suptitle(f"Causal attention, {s} tokens on cp = {cp} ranks (color: the rank holding the query)")
    fig.tight_layout()
    fig.savefig(out / "05_zigzag.png", dpi=110)


def experts(out: Path) -> None:
    c, ep, tokens = get_config("small-moe"), 4, 256
    torch.manual_seed(0)
    moe = MoE(c)
    torch.nn.init.normal_(moe.router.weight, std=c.dim**-0.5)
    chosen = moe.probabilities(torch.randn(tokens, c.dim)).topk(c.top_k, dim=-1).indices  # [T, k]
    per_rank, local = tokens // ep, c.n_experts // ep
    sent = torch.zeros(ep, ep, dtype=torch.long)  # [from the token's rank, to the expert's rank]
    for t, row in enumerate(chosen.tolist()):
        for e in row:
            sent[t // per_rank, e // local] += 1
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    ax.imshow(sent, cmap="Blues")
    for i in range(ep):
        for j in range(ep):
            ax.text(j, i, int(sent[i, j]), ha="center", va="center", color="black" if i != j else "darkred")
    ax.set_xticks(range(ep), [f"rank {j}\nexperts {j * local}-{j * local + local - 1}" for j in range(ep)], fontsize=8)
    ax.set_yticks(range(ep), [f"rank {i}" for i in range(ep)])
    ax.set_xlabel("to the rank holding the expert")
    ax.set_ylabel(f"from the rank holding the token ({per_rank} tokens)")
    off = int(sent.sum() - sent.diagonal().sum())
    ax.set_title(f"One MoE layer's all-to-all, top-{c.top_k} of {c.n_experts} experts at ep {ep}:\n"
                 f"{off} of {int(sent.sum())} assignments leave their rank (diagonal: stay)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "07_expert_all_to_all.png", dpi=110)


GB = 1e9  # an H100's 80 GB are decimal (planner.Cluster.memory)


def one_device_memory() -> dict[str, dict[str, int]]:
    """What one device would hold for each real model, in bytes by kind: bf16-mixed, one sequence of
    4,096 tokens (chapter 0's table: scripts/course/step_00_one_device.py)."""
    held = {}
    for name in ("1b", "8b", "70b"):
        c = get_config(name)
        cfg = TrainConfig(model=name, seq_len=4096, micro_batch=1, global_batch=1, precision="bf16-mixed")
        held[name] = {**held_bytes(c, cfg), "activations": activation_bytes(c, cfg)}
    return held


def memory(out: Path) -> None:
    kinds = ("params", "grads", "optimizer", "activations")
    labels = ("weights (bf16) + fp32 masters", "gradients (bf16)", "AdamW momentum, variance (fp32)",
              "activations (one 4,096-token sequence)")
    held = one_device_memory()
    fig, ax = plt.subplots(figsize=(7, 4.6))
    names, bottom = list(held), [0.0] * len(held)
    for kind, label, color in zip(kinds, labels, [*COLORS[:3], "#8172b3"]):
        gib = [held[n][kind] / 2**30 for n in names]
        ax.bar(names, gib, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, gib)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:,.0f} GiB\n({total * 2**30 / (80 * GB):.1f} H100s)", ha="center", va="bottom",
                fontsize=8)
    ax.axhline(80 * GB / 2**30, color="black", linestyle="--", linewidth=1, label="one H100: 80 GB (74.5 GiB)")
    ax.set_ylim(0, max(bottom) * 1.12)
    ax.set_ylabel("GiB on one device")
    ax.set_title("One device, bf16-mixed: model states (16 bytes a parameter) and activations", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "00_one_device_memory.png", dpi=110)


RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")
RING_N = range(2, 33)
RING_PAYLOAD = math.lcm(*RING_N)  # bytes: a payload every N divides, so no byte is lost to rounding


def ring_curves(nbytes: int = RING_PAYLOAD) -> dict[str, list[float]]:
    """Bytes each rank sends per byte of an nbytes payload, by op, for N = 2 .. 32 (ring_bytes_sent)."""
    return {op: [ring_bytes_sent(op, nbytes, n) / nbytes for n in RING_N] for op in RING_OPS}


def ring(out: Path) -> None:
    curves = ring_curves()
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    styles = {"all_reduce": ("-o", "all-reduce: 2(N-1)/N"), "all_gather": ("-s", "all-gather: (N-1)/N"),
              "reduce_scatter": (":x", "reduce-scatter: (N-1)/N")}
    for (op, curve), color in zip(curves.items(), COLORS):
        style, label = styles[op]
        ax.plot(list(RING_N), curve, style, color=color, label=label, markersize=4)
    for level in (1, 2):
        ax.axhline(level, color="grey", linewidth=0.6, linestyle="--")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("bytes each rank sends / payload bytes S")
    ax.set_ylim(0, 2.2)
    ax.set_title("The ring's cost per rank is nearly flat in N (collectives.ring_bytes_sent)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "01_ring_bytes.png", dpi=110)


BUCKET_MB, BUCKET_DP = 1.0, 4


def gradient_buckets() -> list[tuple[str, int, int]]:
    """The small model's DataParallel buckets in float32 at bucket_mb 1, in backward order, as
    (first .. last parameter, payload bytes, bytes each of 4 dp ranks sends for its all-reduce)."""
    model = Llama(get_config("small"), seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    rows = []
    for params in by_grad_mean(list(reversed(list(model.parameters())))).values():  # as DataParallel._make_buckets
        for chunk in bucket_params(params, BUCKET_MB):
            nbytes = sum(p.numel() * p.element_size() for p in chunk)
            rows.append((f"{names[id(chunk[0])]} .. {names[id(chunk[-1])]}", nbytes,
                         ring_bytes_sent("all_reduce", nbytes, BUCKET_DP)))
    return rows


def buckets(out: Path) -> None:
    rows = gradient_buckets()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    y = list(range(len(rows)))
    ax.barh([i + 0.2 for i in y], [r[1] / 2**20 for r in rows], height=0.4, color=COLORS[0], label="bucket's gradients")
    ax.barh([i - 0.2 for i in y], [r[2] / 2**20 for r in rows], height=0.4, color=COLORS[1],
            label=f"sent by each rank in its all-reduce, dp {BUCKET_DP}: 2(N-1)/N = 1.5 x")
    ax.set_yticks(y, [f"bucket {i}\n" + r[0].replace(" .. ", " ..\n") for i, r in enumerate(rows)], fontsize=7)
    ax.invert_yaxis()  # bucket 0, the first backward fills, at the top
    ax.axvline(BUCKET_MB, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel(f"MiB (dashed: bucket_mb = {BUCKET_MB:g}, a bucket closes once it reaches it)")
    ax.set_title(f"small model, float32: {len(rows)} gradient buckets in the order backward fills them", fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(out / "02_gradient_buckets.png", dpi=110)


PLANNED = dict(model="8b", cluster=Cluster(8), seq_len=8192, global_batch=1024)


def layout_points() -> list[tuple[str, int, float]]:
    """Every layout the planner weighs for 8b on 8 H100s: (its flags, its fullest rank's bytes, its step's
    seconds), by the planner's own functions (planner.plan keeps those whose bytes fit in 80 GB less the
    headroom; it times only those, so the others are timed here)."""
    c, cluster = get_config(PLANNED["model"]), PLANNED["cluster"]
    return [(ch.flags(), ch.memory, (ch.time or step_time(c, ch.cfg, cluster))["total"])
            for ch in weigh(PLANNED["model"], cluster, PLANNED["seq_len"], PLANNED["global_batch"])]


def planned(out: Path) -> None:
    points, limit = layout_points(), PLANNED["cluster"].usable
    fits = [p for p in points if p[1] <= limit]
    too_big = [p for p in points if p[1] > limit]
    best = min(fits, key=lambda p: p[2])
    fig, ax = plt.subplots(figsize=(7.4, 4.8))
    ax.scatter([p[2] for p in too_big], [p[1] / GB for p in too_big], marker="x", color="grey", s=18,
               label=f"does not fit ({len(too_big)})")
    ax.scatter([p[2] for p in fits], [p[1] / GB for p in fits], color=COLORS[0], s=14,
               label=f"fits ({len(fits)})")
    ax.scatter([best[2]], [best[1] / GB], s=160, facecolors="none", edgecolors=COLORS[3], linewidths=2,
               label=f"the planner's pick: {best[0]}")
    ax.axhline(limit / GB, color="black", linestyle="--", linewidth=1)
    ax.text(ax.get_xlim()[1], limit / GB, f"{limit / GB:.0f} GB: 80 less 10% headroom ", ha="right", va="bottom",
            fontsize=8)
    ax.set_xlabel("step time, seconds (planner.step_time)")
    ax.set_ylabel("GB on the fullest rank (estimate.peak_bytes)")
    ax.set_title(f"8b on 8 H100s, seq {PLANNED['seq_len']:,}, {PLANNED['global_batch']:,} sequences a step: "
                 "every layout", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "08_layouts_8b.png", dpi=110)


PARITY_RUN = ["--model", "tiny", "--vocab-size", "512", "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2",
              "--steps", "40", "--lr", "3e-3", "--warmup", "5", "--dtype", "float64", "--log-every", "100",
              "--no-wandb"]
LAYOUTS = {"one process": [], "dp 2": ["--dp", "2"], "tp 2 + sp": ["--tp", "2", "--sp"], "pp 2 (1F1B)": ["--pp", "2"],
           "cp 2": ["--cp", "2"], "dp 2, ZeRO-3": ["--dp", "2", "--zero", "3"]}


def launch(run: list[str], flags: list[str], folder: Path, ranks: int) -> subprocess.Popen:
    """scripts/train.py `run` `flags` on `ranks` processes of one thread each, logging every step to
    folder/log.jsonl (the data's cache: folder's parent's "cache", unless `run` names one)."""
    folder.mkdir(parents=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cache = [] if "--cache-dir" in run else ["--cache-dir", str(folder.parent / "cache")]
    argv = [*launcher, str(ROOT / "scripts" / "train.py"), *run, *flags, "--out", str(folder / "out"),
            "--log-json", str(folder / "log.jsonl"), *cache]
    return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def step_records(run: subprocess.Popen, folder: Path) -> list[dict]:
    """The run's records of its steps, once it has ended (SystemExit with its stderr's end if it failed)."""
    _, err = run.communicate()
    if run.returncode:
        raise SystemExit(f"{' '.join(map(str, run.args[6:]))} failed:\n{err[-2000:]}")
    return [r for r in map(json.loads, (folder / "log.jsonl").read_text().splitlines()) if "loss" in r]


def losses(flags: list[str], folder: Path) -> list[float]:
    return [r["loss"] for r in step_records(launch(PARITY_RUN, flags, folder, 1 if not flags else 2), folder)]


def parity(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        curves = {name: losses(flags, Path(tmp) / str(i)) for i, (name, flags) in enumerate(LAYOUTS.items())}
    reference = curves["one process"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 2))
    steps = range(1, len(reference) + 1)
    for i, (name, curve) in enumerate(curves.items()):
        top.plot(steps, curve, label=name, linewidth=4 - 0.5 * i, alpha=0.8, color=f"C{i}")
        if name != "one process":
            bottom.semilogy(steps, [abs(a - b) or 1e-18 for a, b in zip(curve, reference)], label=name,
                            color=f"C{i}", marker="o", markersize=3, linestyle="none")
    top.set_ylabel("training loss")
    top.set_title("tiny Llama, float64: the same run under six layouts")
    top.legend(fontsize=8)
    bottom.set_ylabel("|loss - one process|\n(0 drawn at 1e-18)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "09_loss_parity.png", dpi=110)


def zeropp_bars() -> dict[str, dict[str, int]]:
    """Bytes one rank sends per micro-batch for one ZeRO-3 unit (a layer of 8b, bf16) at dp 16 on 2 nodes
    of 8, by where they travel: {variant: {"inside a node": ..., "across nodes": ...}}. A dp message
    rides a ring over both nodes: 2 of its 16 hops cross, so its bytes are split 14/16 inside and
    2/16 across (the ranks' mean share); dp_intra stays inside, dp_cross crosses."""
    from minipar.layout import Layout
    from minipar.planning.estimate_zeropp import bucket_messages

    c = get_config("8b")
    unit = 2 * c.dim * c.dim + 2 * c.dim * c.n_kv_heads * c.head_dim + 3 * c.dim * c.ffn_dim  # q, o; k, v; MLP
    unit = -(-unit // 16) * 16
    bars = {}
    for variant in ("", "qwz", "hpz", "qgz", "qwz,hpz,qgz"):
        cfg = Layout(model="8b", dp=16, zero=3, zeropp=variant or None, ranks_per_node=8, precision="bf16-mixed")
        inside = across = 0.0
        for name, nbytes in bucket_messages(unit, cfg, width=2, wire=2):
            group = name.split("/")[0]
            if group == "dp_intra":
                inside += nbytes
            elif group == "dp_cross":
                across += nbytes
            else:
                inside, across = inside + nbytes * 14 / 16, across + nbytes * 2 / 16
        bars[variant or "ZeRO-3"] = {"inside a node": inside, "across nodes": across}
    return bars


def zeropp_figure(out: Path) -> None:
    bars = zeropp_bars()
    fig, ax = plt.subplots(figsize=(7.4, 4.2))
    names = list(bars)
    inside = [bars[n]["inside a node"] / 2**20 for n in names]
    across = [bars[n]["across nodes"] / 2**20 for n in names]
    ax.bar(names, inside, color=COLORS[0], label="inside a node (NVLink)")
    ax.bar(names, across, bottom=inside, color=COLORS[3], label="across nodes (InfiniBand)")
    for i in range(len(names)):
        ax.text(i, inside[i] + across[i], f"{across[i]:.0f} MiB across", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("MiB one rank sends per micro-batch\n(one 8b layer, bf16)")
    ax.set_title("ZeRO++'s two hops at dp 16 on 2 nodes of 8 (estimate_zeropp.bucket_messages)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "03c_zeropp_hops.png", dpi=110)


def _course_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name.split("_")[1], ROOT / "scripts" / "course" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def roofline_points() -> dict[str, list[tuple[str, float]]]:
    """{"hbm": [(8b matmul at T, FLOP per byte of HBM)], "nvlink"/"infiniband": [(model tp, FLOP per byte
    sent)]}: part (a)'s and part (b)'s arithmetic of step_08c_roofline.py."""
    script = _course_script("step_08c_roofline.py")
    c = get_config("8b")
    hbm = [(f"{name} T={t:,}", f / b) for name, n_in, n_out in script.matmuls(c) if name in ("q", "k", "down")
           for t in script.TOKENS for f, b in [script.flops_and_bytes(t, n_in, n_out)]]
    links = {"nvlink": [], "infiniband": []}
    for model, tp, link, flops, sent, _ in script.tp_rows():
        links[link.lower()].append((f"{model} tp {tp}", flops / sent))
    return {"hbm": hbm, **links}


def roofline(out: Path) -> None:
    h100, points = Cluster(8), roofline_points()
    fig, ax = plt.subplots(figsize=(7.4, 4.8))
    xs = [2.0**e for e in range(-1, 17)]
    roofs = (("HBM3", h100.memory_bandwidth, COLORS[0], "hbm"), ("NVLink", h100.intra_bandwidth, COLORS[2], "nvlink"),
             ("InfiniBand", h100.inter_bandwidth, COLORS[3], "infiniband"))
    for name, bw, color, key in roofs:
        ax.loglog(xs, [min(h100.flops, x * bw) / 1e12 for x in xs], color=color,
                  label=f"{name} {bw / 1e9:,.0f} GB/s: ridge {h100.flops / bw:,.0f} FLOP/byte")
        for label, x in points[key]:
            ax.plot([x], [min(h100.flops, x * bw) / 1e12], "o", color=color, markersize=4)
            if label in ("q T=1", "q T=512", "1b tp 8", "8b tp 8", "1b tp 16", "8b tp 16", "70b tp 16"):
                up = label in ("q T=512", "8b tp 8")
                ax.annotate(label, (x, min(h100.flops, x * bw) / 1e12), fontsize=7, xytext=(-10, 8 if up else -12),
                            textcoords="offset points")
    ax.set_xlabel("FLOPs per byte moved (HBM) or sent (tp's all-reduces)")
    ax.set_ylabel("attainable TFLOP/s (bf16 peak 989)")
    ax.set_title("the roofline of an H100: 8b's matmuls, and tp's messages", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "08_roofline.png", dpi=110)


MESH = dict(world_size=16, pp=2, dp=2, cp=2, tp=2, ranks_per_node=8)


def mesh_cells() -> list[tuple[int, int, dict[str, int]]]:
    """(rank, its node, its coordinates) of chapter 9's 16 ranks on two nodes of 8 (mesh.MeshLayout)."""
    from minipar.mesh import MeshLayout

    layout = MeshLayout(**MESH)
    return [(r, layout.node(r), layout.coords(r)) for r in range(layout.world_size)]


def mesh(out: Path) -> None:
    from minipar.mesh import MeshLayout

    layout, cells = MeshLayout(**MESH), mesh_cells()
    fig, ax = plt.subplots(figsize=(8.2, 3.6))
    place = {}
    for rank, node, co in cells:
        x = node * 4.6 + (rank % 8) % 4 * 1.05
        y = 1.3 - (rank % 8) // 4 * 1.3
        place[rank] = (x, y)
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=COLORS[co["dp"]] + "55", edgecolor="black"))
        ax.text(x + 0.45, y + 0.6, f"rank {rank}", ha="center", fontsize=8)
        ax.text(x + 0.45, y + 0.25, f"pp{co['pp']} dp{co['dp']}\ncp{co['cp']} tp{co['tp']}", ha="center", fontsize=6)
    for node in range(layout.nodes):
        ax.add_patch(Rectangle((node * 4.6 - 0.15, -0.15), 4.35, 2.55, fill=False, linestyle="--"))
        ax.text(node * 4.6 + 2.0, 2.5, f"node {node} (pp stage {node})", ha="center", fontsize=9)
    for dim, color, dy in (("tp", "black", -0.12), ("cp", COLORS[2], -0.05), ("pp", COLORS[3], 0.92)):
        for i, group in enumerate(layout.groups(dim)):
            (x0, y0), (x1, y1) = place[group[0]], place[group[-1]]
            lift = dy + (0.1 * (i % 4) if dim == "pp" else 0)  # the 8 pp pairs, apart
            ax.plot([x0 + 0.45, x1 + 0.45], [y0 + lift, y1 + lift], color=color, linewidth=1.5, marker="o",
                    markersize=3, label=dim if i == 0 else None)
    ax.set_xlim(-0.4, 9.2)
    ax.set_ylim(-0.4, 3.0)
    ax.axis("off")
    ax.set_title("pp 2 x dp 2 x cp 2 x tp 2 on two nodes of 8: tp and cp inside a node, pp across "
                 "(colour: dp replica)", fontsize=9)
    ax.legend(fontsize=7, loc="lower center", ncol=3, bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(out / "09_mesh_nodes.png", dpi=110)


def commit_timeline(steps: int = 8, kill: int = 3, timeout: float = 1.5, restart: float = 4.0,
                    heal: float = 0.5) -> list[tuple[int, float, float, str, int]]:
    """The commit protocol of two replica groups in step units (one step of both groups = 1), as
    segments (group, start, end, what, step): "step" (committed), "not committed" (the step in flight
    when group 1 dies: its allreduce fails, the vote says no, nothing changes), "stall" (waiting for the failed
    allreduce, up to the timeout), "redo" (the step taken again without the dead group), "restart",
    "heal" (the peer's state downloaded). Group 1 dies during step `kill`; while P of R = 2 groups
    take part a step takes R / P as long (replicas.rows: the survivors take the missing group's rows)."""
    segments, t, alone_until = [], 0.0, None
    for step in range(1, steps + 1):
        if step == kill:
            segments += [(0, t, t + 1, "not committed", step), (1, t, t + 0.5, "not committed", step)]  # 1 dies
            segments.append((0, t + 1, t + 1 + timeout, "stall", step))
            t += 1 + timeout
            segments.append((0, t, t + 2, "redo", step))  # P = 1 of R = 2: twice as long, then committed
            back = t - timeout - 0.5 + restart  # group 1's restart began when it died
            segments.append((1, t - timeout - 0.5, back, "restart", step))
            t += 2
            alone_until = back
            continue
        if alone_until is not None and t < alone_until:
            segments.append((0, t, t + 2, "step", step))
            t += 2
            continue
        if alone_until is not None:  # the next quorum takes group 1 back: it heals, then both step
            segments.append((1, t, t + heal, "heal", step))
            segments.append((0, t, t + heal, "quorum", step))
            t += heal
            alone_until = None
        segments += [(0, t, t + 1, "step", step), (1, t, t + 1, "step", step)]
        t += 1
    return segments


def commit(out: Path) -> None:
    colors = {"step": COLORS[0], "not committed": "#8fa9d6", "redo": COLORS[1], "stall": "#bbbbbb",
              "restart": COLORS[3], "heal": COLORS[2],
              "quorum": "#dddddd"}
    fig, ax = plt.subplots(figsize=(8.4, 2.8))
    seen = set()
    for group, start, end, what, step in commit_timeline():
        ax.broken_barh([(start, end - start)], (1 - group - 0.35, 0.7), facecolors=colors[what], edgecolor="black",
                       label=what if what not in seen else None)
        seen.add(what)
        if what in ("step", "redo", "not committed"):
            ax.text((start + end) / 2, 1 - group, str(step), ha="center", va="center", fontsize=7, color="white")
    kill = next(s for g, s, e, w, _ in commit_timeline() if g == 1 and w == "restart")
    ax.annotate("SIGKILL", (kill, 0), xytext=(kill, -0.75), ha="center", fontsize=8,
                arrowprops=dict(arrowstyle="->"))
    ax.set_yticks([1, 0], ["group 0", "group 1"])
    ax.set_xlabel("time, in steps of both groups (a step of one group alone: R / P = 2)")
    ax.set_title("the commit protocol: a kill, the survivor's stall and redone step, a restart, a heal", fontsize=9)
    ax.legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.set_ylim(-1.0, 1.6)
    fig.tight_layout()
    fig.savefig(out / "10b_commit_timeline.png", dpi=110)


NS_SHAPE, NS_STEPS = (256, 128), (0, 1, 3, 5)


def ns_spectra() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(the spectrum built in, {Newton-Schulz steps: the singular values after them, largest first}) of a
    [256, 128] matrix U diag(s) V^T, s spread log-evenly from 1 to 1e-3 (seed 0); 0 steps: the matrix
    scaled as Newton-Schulz scales it (Frobenius norm 1)."""
    g = torch.Generator().manual_seed(0)
    rows, cols = NS_SHAPE
    u, _ = torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -3, cols, dtype=torch.float64)
    m = u @ torch.diag(s) @ v.T
    after = {k: torch.linalg.svdvals(newton_schulz(m, k).double() if k else m / m.norm()) for k in NS_STEPS}
    return s, after


def muon(out: Path) -> None:
    s, after = ns_spectra()
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    for (k, values), color in zip(after.items(), ["grey", *COLORS]):
        label = "before (scaled to norm 1)" if k == 0 else f"after {k} Newton-Schulz step{'s' * (k > 1)}"
        ax.plot(s.tolist(), values.tolist(), "-" if k else "--", color=color, label=label)
    ax.axhspan(0.7, 1.2, color="#55a868", alpha=0.12, label="[0.7, 1.2]")
    ax.axvline(0.1, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("singular value of M, as a share of the largest")
    ax.set_ylabel("singular value after")
    ax.set_title("Newton-Schulz lifts the singular values above a tenth of the largest to near 1 (bf16)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "04c_newton_schulz.png", dpi=110)


# make train's run (the small model, the standard library's source, 16 x 128 tokens a step, the warm-up and
# cosine), on one process for 300 steps; AdamW at its --lr 3e-3 and Muon at its defaults (--muon-lr 0.02).
MUON_RUN = ["--model", "small", "--steps", "300", "--log-every", "100", "--no-wandb"]
OPTIMIZER_RUNS = {"AdamW": [], "Muon": ["--optimizer", "muon"]}
SMOOTH = 20  # steps in the running mean drawn over each curve


def optimizer_curves(run: list[str] = MUON_RUN) -> dict[str, tuple[list[int], list[float], list[float | None]]]:
    """{optimizer: (tokens seen after each step, its loss, its Muon lr)}: `run` twice, under AdamW and
    --optimizer muon, at the same time (one process and one thread each: this machine's two cores), after
    one step of it alone, which tokenises the data into the cache that both then read."""
    with tempfile.TemporaryDirectory() as tmp:
        step_records(launch(run, ["--steps", "1"], Path(tmp) / "data", 1), Path(tmp) / "data")
        folders = {name: Path(tmp) / name for name in OPTIMIZER_RUNS}
        runs = {name: launch(run, flags, folders[name], 1) for name, flags in OPTIMIZER_RUNS.items()}
        logs = {name: step_records(runs[name], folders[name]) for name in runs}
    return {name: ([round(r["step"] * r["tokens_per_s"] * r["step_time_s"]) for r in log],  # step x tokens a step
                   [r["loss"] for r in log], [r["muon_lr"] for r in log]) for name, log in logs.items()}


def muon_loss(out: Path, run: list[str] = MUON_RUN) -> dict:
    """The figure of optimizer_curves(run); returns them."""
    curves = optimizer_curves(run)
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    for (name, (tokens, loss, _)), color in zip(curves.items(), COLORS):
        n = min(SMOOTH, len(loss))
        mean = [sum(loss[max(0, i + 1 - n) : i + 1]) / len(loss[max(0, i + 1 - n) : i + 1]) for i in range(len(loss))]
        millions = [t / 1e6 for t in tokens]
        ax.plot(millions, loss, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(millions, mean, color=color, label=f"{name}: last {n} steps' mean {mean[-1]:.3f}")
    ax.set_xlabel("tokens trained on (millions)")
    ax.set_ylabel(f"training loss (thin: each step; thick: mean of {SMOOTH})")
    ax.set_title("small Llama on the standard library's source, one process: Muon against AdamW", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "04c_loss_muon_adamw.png", dpi=110)
    return curves


def recompute_bytes() -> dict[str, dict[str, int]]:
    """{recompute setting: its numbers}, under chapter 11's pick for 70b on 64 GPUs (step_11_selective_recompute.py's
    layout and settings): "kept", what a layer keeps for backward (estimate.layer_activation_bytes);
    "replayed", what selective's replay holds during its layer's backward (estimate.replayed_bytes; 0 for
    the others); "rank", pp rank 0's activations at their peak (estimate.activation_bytes: 8 micro-batches
    of its 10 layers, one layer rebuilt, the weights' bf16 copies); "redone", matmul FLOPs a token replayed."""
    script, c = _course_script("step_11_selective_recompute.py"), get_config("70b")
    pick, redone = script.the_pick(c), script.redone_flops(script.layer_flops(c))
    numbers = {}
    for name, mode in script.MODES.items():
        cfg = replace(pick, **mode)
        numbers[name] = {"kept": layer_activation_bytes(c, cfg), "rank": activation_bytes(c, cfg),
                         "replayed": replayed_bytes(c, cfg) if cfg.recompute_selective else 0, "redone": redone[name]}
    return numbers


def recompute(out: Path) -> None:
    numbers = recompute_bytes()
    names = [n.replace(" (", "\n(").replace("-recompute-", "-recompute-\n") for n in numbers]
    fig, (layer, rank) = plt.subplots(1, 2, figsize=(10.5, 4.8))
    layer.bar(names, [v["kept"] / 2**20 for v in numbers.values()], color=[COLORS[3], COLORS[0], "grey", "grey"])
    for i, v in enumerate(numbers.values()):
        replay = f"\n+ {v['replayed'] / 2**20:.0f} MiB during\nits own backward" if v["replayed"] else ""
        redone = f"redoes {v['redone'] / 1e9:.2f} GFLOP\na token" if v["redone"] else "redoes nothing"
        layer.text(i, v["kept"] / 2**20, f"{v['kept'] / 2**20:.1f} MiB{replay}\n{redone}", ha="center", va="bottom",
                   fontsize=7)
    layer.set_ylim(0, max(v["kept"] for v in numbers.values()) / 2**20 * 1.3)
    layer.set_ylabel("MiB (estimate.layer_activation_bytes)")
    layer.set_title("what a layer keeps for backward, one micro-batch", fontsize=9)
    rank.bar(names, [v["rank"] / 2**30 for v in numbers.values()], color=[COLORS[3], COLORS[0], "grey", "grey"])
    for i, v in enumerate(numbers.values()):
        rank.text(i, v["rank"] / 2**30, f"{v['rank'] / 2**30:.1f} GiB", ha="center", va="bottom", fontsize=7)
    rank.set_ylabel("GiB (estimate.activation_bytes)")
    rank.set_title("pp rank 0's activations at their peak: 8 micro-batches x 10 layers kept,\n"
                   "with recompute one layer's replay, and the weights' bf16 copies", fontsize=9)
    for ax in (layer, rank):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("70b, --tp 2 --pp 8 --cp 4 --sp --zero 1, bf16, 8,192 tokens: before selective recompute (red), "
                 "after (blue), and the others", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "11_memory_per_layer.png", dpi=110)


FIGURES = {"memory": memory, "ring": ring, "buckets": buckets, "zero": zero, "tp": tp, "muon": muon, "zigzag": zigzag,
           "experts": experts, "layouts": planned, "parity": parity, "zeropp": zeropp_figure, "roofline": roofline,
           "mesh": mesh, "commit": commit, "muon-loss": muon_loss,
           "recompute": recompute}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", choices=[[], *FIGURES], help="the figures to draw (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "figures", help="a new folder for the PNGs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with refusals():
        unoccupied(args.out, "--out")
    with new_folder(args.out, "--out") as folder:  # built beside --out, renamed into place when all are drawn
        for name in args.names or FIGURES:
            FIGURES[name](folder)
            print(f"drew {name}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
