"""Step 8: what a rank holds, predicted before it runs and then measured; then choosing a layout.

    .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/course/step_08_plan.py

(a) model states: for the `small` model in float64 under dp 2 with ZeRO 0-3 and under tp 2 + sp,
    each rank's weights, gradients and optimizer bytes as estimate.py predicts them (from the
    rank's part of the model built on the meta device) and as the wrapper measures them on its
    real tensors once a step's gradients are synced;
(b) activations: the bytes autograd keeps for backward in one forward of the whole model, counted
    with saved-tensor hooks, against the estimate term by term (a layer, the head), with and
    without recompute;
(c) the planner (no processes: arithmetic) on real sizes: an 8B Llama on one node of 8 GPUs and a
    70B one on 64, the fastest layouts that fit and why the usual alternatives lose.

Chapter: docs/08_memory_and_planning.md.
"""

from functools import partial

import torch
import torch.distributed as dist
from course_common import each_rank, leave, say, start_gloo

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import get_config
from minipar.parallelize import adamw, build_grad_sync
from minipar.planning.estimate import activation_bytes, head_activation_bytes, held_bytes, layer_activation_bytes
from minipar.planning.planner import Cluster, plan
from minipar.run.config import TrainConfig
from minipar.run.train import build_model, train_step

SEQ, ROWS = 32, 4  # per step: 4 rows of 32 tokens over the dp ranks, one row per micro-batch


def held_after_sync(cfg: TrainConfig) -> tuple[dict, dict]:
    """(measured, estimated) bytes of this rank once a second step's gradients are synced."""
    c = get_config(cfg.model, vocab_size=256)
    with Mesh.build(dp=cfg.dp, tp=cfg.tp) as mesh:
        model, _ = build_model(cfg, mesh, c, torch.device("cpu"), torch.float64)
        wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr),
                                  zero=cfg.zero, bucket_mb=cfg.bucket_mb, offload=cfg.offload)
        x = torch.randint(0, 256, (ROWS // cfg.dp, SEQ), generator=torch.Generator().manual_seed(mesh.coord("dp")))
        micro = list(zip(x.split(1), x.split(1)))
        train_step(wrapper, micro, 1.0)  # the optimizer state exists from here on
        with wrapper.no_sync():
            for xm, ym in micro:
                wrapper(xm, ym, 1.0).backward()
        wrapper.finish_grad_sync()
        measured = wrapper.held_bytes()
        mesh.destroy()
    return measured, held_bytes(c, cfg)


def part_a() -> None:
    say("(a) bytes each rank holds once gradients are synced (small model, float64, 1.8M parameters):\n"
        "    measured on the tensors | estimated on the meta device")
    for layout in (dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3), dict(tp=2, sp=True)):
        cfg = TrainConfig(model="small", seq_len=SEQ, global_batch=ROWS, micro_batch=1, dtype="float64", **layout)
        measured, estimated = held_after_sync(cfg)
        cells = "  ".join(f"{k} {measured[k]:>9,} | {estimated[k]:>9,}" for k in measured)
        each_rank(" ".join(f"--{k} {v}" if v is not True else f"--{k}" for k, v in layout.items()),
                  f"{cells}   equal: {measured == estimated}")


def kept_for_backward(model, x) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return sum(n for ptr, n in kept.items() if ptr not in params)


def part_b() -> None:
    from minipar.model import Llama
    from minipar.parallelize import parallelize

    c = get_config("small", vocab_size=256)
    say(f"\n(b) activations kept for backward, one micro-batch of 2 x {SEQ} tokens, float64, one rank:")
    for recompute in (False, True):
        cfg = TrainConfig(model="small", seq_len=SEQ, micro_batch=2, dtype="float64", recompute=recompute)
        model = parallelize(Llama(c), recompute=recompute).double()
        x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
        measured = kept_for_backward(model, x)
        layer, head = layer_activation_bytes(c, cfg), head_activation_bytes(c, cfg)
        say(f"  recompute {recompute!s:<5}  a layer {layer:>9,} x {c.n_layers} layers + head {head:>7,} = "
            f"{c.n_layers * layer + head:>9,}   measured in forward {measured:>9,}   the step's peak (a layer "
            f"rebuilt in backward) {activation_bytes(c, cfg):>9,}")


def part_c() -> None:
    for model, gpus, batch in (("8b", 8, 1024), ("70b", 64, 256)):
        fits, too_big = plan(model, Cluster(gpus), seq_len=8192, global_batch=batch)
        say(f"\n(c) {model} on {gpus} H100s (80 GB less 10% headroom, 8 per node), seq 8192, {batch} sequences "
            f"per step: {len(fits)} layouts fit, {too_big} do not; the fastest:")
        for ch in fits[:4]:
            t = ch.time
            say(f"  {ch.flags():<40} {t['total']:8.1f} s (compute {t['compute']:.1f}, tp {t['tp']:.1f}, "
                f"cp {t['cp']:.1f}, pp {t['pp']:.1f}, dp {t['dp']:.1f}, bubble {t['bubble']:.1f})   "
                f"{ch.memory / 1e9:5.1f} GB")


def prose() -> None:
    """--prose: the chapter's paragraphs on part (c)'s picks, their numbers from the planner (no processes)."""
    from minipar.planning.planner import step_time, weigh

    def find(weighed, **want):
        return next(ch for ch in weighed if all(getattr(ch.cfg, k) == v for k, v in want.items())
                    and ch.cfg.schedule != "interleaved")

    def total(c, ch, cluster):
        return ch.time["total"] if ch.time else step_time(c, ch.cfg, cluster)["total"]

    c8, eight = get_config("8b"), Cluster(8)
    weighed = weigh("8b", eight, 8192, 1024)
    pick = plan("8b", eight, seq_len=8192, global_batch=1024)[0][0]
    fastest = min((ch for ch in weighed if ch.memory <= 80e9), key=lambda ch: total(c8, ch, eight))
    full = find(weighed, dp=8, zero=3, recompute=True)
    mlp = find(weighed, dp=8, zero=3, recompute_mlp=True)
    t, gb = pick.time["total"], eight.usable / 1e9
    say_wrapped(f"For an 8B Llama on one node the fastest layout that fits in the whole 80 GB is "
                f"`{fastest.flags()}`, {total(c8, fastest, eight):.1f} s a step. "
                f"It needs {fastest.memory / 1e9:.1f} GB, "
                f"though, and only {gb:.0f} of the 80 may be used: the pick is `{pick.flags()}`, "
                f"{t - total(c8, fastest, eight):.1f} s slower, which {how(pick)}. "
                "(`scripts/tools/plan.py --headroom 0` gives the faster pick back.)")
    say_wrapped("The planner weighs whole-layer recompute with ZeRO-3 too (a layer's replay runs on the gather its "
                f"backward makes anyway, so it adds no bytes: `zero3.py`): `{full.flags()}` fits in "
                f"{full.memory / 1e9:.1f} GB but is {full.time['total'] - t:.2f} s slower per step, all of it compute, "
                f"since replaying every whole layer adds a third of a step's compute (8/6). `{mlp.flags()}`, the MLPs "
                f"alone recomputed, fits in {mlp.memory / 1e9:.1f} GB and is {mlp.time['total'] - t:.2f} s slower than "
                "the pick.")
    many = Cluster(64)
    weighed = weigh("70b", many, 8192, 256)
    fits = plan("70b", many, seq_len=8192, global_batch=256)[0]
    pick, t = fits[0], fits[0].time["total"]
    zero3 = find(weighed, dp=64, zero=3, recompute=True)
    kept = find(weighed, tp=pick.cfg.tp, pp=pick.cfg.pp, cp=pick.cfg.cp, zero=pick.cfg.zero, recompute=False,
                recompute_mlp=False, recompute_selective=False)
    looped = next(ch for ch in fits if ch.cfg.schedule == "interleaved")
    say_wrapped(f"For 70B on 64 GPUs ZeRO-3 over every GPU fits only with recompute (`{zero3.flags()}`, "
                f"{zero3.memory / 1e9:.1f} GB), {zero3.time['total'] - t:.1f} s slower per step than the pick: it "
                f"gathers every weight across InfiniBand for every micro-batch. The pick, `{pick.flags()}`, cuts the "
                f"model inside nodes (tp) and across them (pp), splits the long sequences (cp) and {how(pick)}: the "
                f"same layout keeping every activation needs {kept.memory / 1e9:.1f} GB, over the {gb:.0f} "
                f"usable. Interleaving pays little here: 1F1B's bubble is {pick.time['bubble'] / t:.1%} of the pick's "
                f"step, and the best interleaved layout (`{looped.flags()}`) is "
                f"{looped.time['total'] - t:.1f} s slower.",
                last=True)


def how(choice) -> str:
    """What a pick does with its activations, in the chapter's words."""
    cfg = choice.cfg
    return ("recomputes selectively (chapter 11: the matmuls' outputs kept, the cheap operators replayed)"
            if cfg.recompute_selective else "recomputes the MLPs" if cfg.recompute_mlp else
            "recomputes every layer" if cfg.recompute else
            f"keeps every activation, its bubble and pipeline messages ({choice.time['bubble']:.1f} s and "
            f"{choice.time['pp']:.1f} s) cheaper than recompute")


def say_wrapped(paragraph: str, last: bool = False) -> None:
    """A paragraph of the chapter, wrapped as the chapter wraps it (docs-check compares it line by line)."""
    import textwrap

    print(textwrap.fill(paragraph, 100, break_on_hyphens=False) + ("" if last else "\n"))


def main() -> None:
    import sys

    if sys.argv[1:] == ["--prose"]:
        return prose()
    start_gloo()
    part_a()
    if dist.get_rank() == 0:  # no processes needed from here on
        part_b()
        part_c()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()
