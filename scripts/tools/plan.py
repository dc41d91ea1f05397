"""Which layout should I run? Every layout of the GPUs that fits, fastest first, with the reasons.

    .venv/bin/python scripts/tools/plan.py --model 8b --gpus 64 --gpus-per-node 8 --gpu-memory 80GB \
        --seq-len 8192 --global-batch 1024

Memory is minipar's own estimate (minipar/planning/estimate.py, checked byte for byte against real ranks);
time is the stated model of minipar/planning/planner.py (compute at --mfu of --peak-tflops, communication
at the given bandwidths). A layout fits when its fullest rank stays within --gpu-memory less --headroom.
Nothing runs on a GPU: it is arithmetic, for any number of GPUs. A flag out of its range is one line and
exit code 2 (minipar/ops/args.py).

    .venv/bin/python scripts/tools/plan.py --calibrate

checks that clock here instead (chapter 8, docs/benchmarks.md): it measures this machine (the plain
model's forward and backward on one thread: its FLOP rate; all-reduces of 4 KiB to 4 MiB in groups of
2, 4 and 8 ranks, every group at once: α and β per group size on 2, 4 and 8 processes), predicts with
planner.step_time the step of each layout of CALIBRATED (the small model, train.py's batch in
micro-batches of 2, one thread a rank), then runs each with train.py and tables prediction against
measurement: a few minutes. Everything it writes goes into a temporary folder, removed at the end.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minipar.collectives import ring_bytes_sent
from minipar.layout import Layout
from minipar.model import CONFIGS, Llama, get_config
from minipar.muon import MUON_METHODS
from minipar.ops.args import (
    HelpFormatter,
    Parser,
    byte_size,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    refusals,
)
from minipar.parallelize import adamw
from minipar.planning.planner import HEADROOM, Cluster, plan, step_flops, step_time
from minipar.run.paths import InputError


def share_kept_free(text: str) -> float:
    """--headroom: args.py's number check, then below 1 (a share of memory, 0 keeps nothing free)."""
    value = non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a share of the memory, 0 or more and below 1 "
                                         "(0.1 keeps 10% free)")
    return value


def parse_args(argv=None):
    p = Parser(prog="plan.py", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", default="8b", choices=list(CONFIGS))
    p.add_argument("--gpus", type=positive_int, default=8)
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--gpu-memory", type=byte_size, default="80GB", help="per GPU, e.g. 80GB or 24GiB")
    p.add_argument("--headroom", type=share_kept_free, default=HEADROOM,
                   help="the share of each GPU's memory kept free: CUDA context, NCCL's buffers, fragmentation")
    p.add_argument("--seq-len", type=positive_int, default=8192)
    p.add_argument("--global-batch", type=positive_int, default=1024, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=positive_int, default=1)
    p.add_argument("--peak-tflops", type=positive_float, default=989.0, help="dense bf16 per GPU (H100 SXM: 989)")
    p.add_argument("--mfu", type=fraction, default=0.45, help="the share of peak the matmuls reach")
    p.add_argument("--intra-gbps", type=positive_float, default=450.0, help="GB/s per GPU inside a node (NVLink)")
    p.add_argument("--inter-gbps", type=positive_float, default=50.0, help="GB/s per GPU between nodes (InfiniBand)")
    p.add_argument("--optimizer", choices=("adamw", "muon", "both"), default="adamw",
                   help="the optimizer of the layouts weighed: adamw, muon (each --muon-method under ZeRO: one "
                        "momentum buffer where AdamW holds two, plus Newton-Schulz and its gathers), or both, "
                        "ranked together (the choice of optimizer changes the training: the planner weighs, you pick)")
    p.add_argument("--top", type=positive_int, default=8, help="how many layouts to list")
    p.add_argument("--sizes", action="store_true", help="print the dense named sizes' shapes and parameters, and exit")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine, predict and run the layouts of --calibrate-layouts (minutes)")
    p.add_argument("--calibrate-layouts", default=";".join(CALIBRATED), metavar="FLAGS;FLAGS",
                   help="train.py's layout flags of each layout, ';' between layouts ('' is one rank)")
    p.add_argument("--calibrate-steps", type=positive_int, default=15,
                   help=f"steps of each run (the first 5 unmeasured; at most {MAX_CALIBRATE_STEPS})")
    args, defaults = p.parse_args(argv), p.parse_args([])  # defaults as read: --gpu-memory's "80GB" is 80e9
    idle = [k for k in vars(args) if k != "calibrate" and k.startswith("calibrate") != args.calibrate
            and getattr(args, k) != getattr(defaults, k)]  # named at its default, a flag asks for nothing
    if idle:  # refused, as train.py refuses a flag that would change nothing (layout.py: acts_with)
        flag = "--" + idle[0].replace("_", "-")
        raise InputError(f"{flag} acts only with --calibrate, which this command has not: it would change nothing; "
                         f"leave it out" if not args.calibrate else f"{flag} with --calibrate, which measures the "
                         f"small model on this machine and plans nothing: it would change nothing; leave it out")
    return args


def row(choice, width: int) -> str:
    t = choice.time
    return (f"  {choice.flags():<{width}} {t['total']:>9.2f} s = compute {t['compute']:.2f} + tp {t['tp']:.2f} + "
            f"cp {t['cp']:.2f} + pp {t['pp']:.2f} + dp {t['dp']:.2f} + bubble {t['bubble']:.2f}   "
            f"{choice.memory / 1e9:5.1f} GB")


def recomputes(cfg) -> bool:
    return cfg.recompute or cfg.recompute_mlp or cfg.recompute_selective


def why_not(best, fits, args, cluster) -> list[str]:
    """The alternatives people reach for first, and what the model says of each."""
    lines = []
    common = {"plain data parallelism": lambda x: x.dp * x.cp == args.gpus and x.zero == 0 and not recomputes(x),
              "ZeRO-3 over every GPU (FSDP)": lambda x: x.dp == args.gpus and x.zero == 3 and not recomputes(x),
              "ZeRO-3 over every GPU with recompute": lambda x: x.dp == args.gpus and x.zero == 3 and x.recompute,
              f"tensor parallelism over a node (tp {args.gpus_per_node})": lambda x: x.tp == args.gpus_per_node,
              "pipeline parallelism": lambda x: x.pp > 1,
              "interleaved pipeline stages": lambda x: x.virtual_stages > 1,
              "recompute of whole layers": lambda x: x.recompute,
              "selective recompute (the cheap ops)": lambda x: x.recompute_selective,
              "recompute of the MLPs (the most expensive part)": lambda x: x.recompute_mlp}
    if args.optimizer != "adamw":  # Muon's methods (muon.py), and AdamW where both are weighed
        common |= {f"Muon, --muon-method {m}": lambda x, m=m: x.optimizer == "muon" and x.muon_method == m and x.zero
                   for m in MUON_METHODS}
        common |= {"AdamW": lambda x: x.optimizer == "adamw"} if args.optimizer == "both" else {}
    for name, test in common.items():
        if test(best.cfg):
            lines.append(f"  {name}: the choice itself")
            continue
        match = next((ch for ch in fits if test(ch.cfg)), None)
        if match is None:
            lines.append(f"  {name}: no such layout fits in {cluster.usable / 1e9:.1f} GB per GPU")
        else:
            slower = {k: v - best.time[k] for k, v in match.time.items() if k != "total" and v > best.time[k]}
            worst = max(slower, key=slower.get) if slower else "nothing"
            lines.append(f"  {name}: best is {match.flags()}, {match.time['total'] - best.time['total']:.2f} s "
                         f"slower per step (mostly {worst})")
    return lines


# ----------------------------------------------------------------------------------------------
# --calibrate: the clock against this machine
# ----------------------------------------------------------------------------------------------

HERE = dict(model="small", seq_len=128, global_batch=16, micro_batch=2)  # train.py's, in micro-batches of 2
CALIBRATED = ("", "--dp 2", "--tp 2", "--pp 2", "--cp 2", "--dp 4", "--tp 4", "--dp 2 --tp 2", "--dp 2 --pp 2",
              "--tp 2 --pp 2", "--dp 8", "--dp 4 --tp 2", "--dp 2 --tp 2 --pp 2")
SIZES = (2**12, 2**22)  # bytes of the timed all-reduces: a latency-bound one and a bandwidth-bound one
WARMUP = 5  # unmeasured steps of each run: the allocator, the first messages of each group
MAX_CALIBRATE_STEPS = 1000  # steps of each run: thirteen layouts of more run for hours


def layout_of(flags: str) -> Layout:
    """The Layout of train.py's degree flags ("--dp 2 --tp 2") under HERE; anything else is refused."""
    words = flags.split()
    names = words[::2]
    if len(words) % 2 or len(set(names)) < len(names) or any(
            k not in ("--dp", "--tp", "--pp", "--cp") or not re.fullmatch("[0-9]{1,6}", v)  # not "²", not 10**20
            for k, v in zip(words[::2], words[1::2])):
        raise InputError(f"--calibrate-layouts: {flags!r} is not a layout: give degrees, each once, e.g. "
                         f"'--dp 2 --tp 2'")
    return Layout(**HERE, **{k[2:]: int(v) for k, v in zip(words[::2], words[1::2])})


def ranks(cfg: Layout) -> int:
    return cfg.dp * cfg.tp * cfg.pp * cfg.cp


def compute_rate(reps: int = 3) -> float:
    """FLOP/s (by step_flops) of the small model's whole step on one thread: HERE's global batch in its
    micro-batches, forward and backward, then the norm's clip and AdamW: the rate the matmuls and all
    between them reach here, the data's and the log's work left out."""
    c, gen = get_config(HERE["model"]), torch.Generator().manual_seed(0)
    model = Llama(c)
    optimizer = adamw([{"params": list(model.parameters())}], lr=1e-3)
    tokens = torch.randint(c.vocab_size, (HERE["global_batch"], HERE["seq_len"] + 1), generator=gen)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for batch in tokens.split(HERE["micro_batch"]):
            model(batch[:, :-1], batch[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return step_flops(c, layout_of("")) / statistics.median(times[1:])


def _between_work(group, nbytes: int, reps: int = 30) -> float:
    """Seconds a message adds to a loop of ~1 ms matmuls that every rank runs at once (a tp layer's
    compute between two messages, about): the loop with an all-reduce after each matmul, less without."""
    a, x = torch.randn(160, 160), torch.zeros(nbytes // 4)
    loops = []
    for message in (True, False):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            for _ in range(4):
                a = torch.tanh(a @ a)
            if message:
                dist.all_reduce(x, group=group)
        loops.append(time.perf_counter() - start)
    return (loops[0] - loops[1]) / reps


def _measure(rank: int, world: int, store: str, out: dict) -> None:
    """One of `world` processes on this machine, one thread each, all at once: the model's FLOP rate, then
    for each group size a message's cost of SIZES' bytes between compute, every group at once."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dist.barrier()
    out[("rate", rank)] = compute_rate()
    for size in (g for g in (2, 4, 8) if g <= world):
        groups = [dist.new_group(list(range(i, i + size))) for i in range(0, world, size)]
        for nbytes in SIZES:
            _between_work(groups[rank // size], nbytes, reps=3)  # the group's first messages
            cost = _between_work(groups[rank // size], nbytes)
            out[(size, nbytes, rank)] = cost
    dist.barrier()
    dist.destroy_process_group()


def machine_costs(world: int) -> tuple[float, tuple[tuple[int, float, float], ...]]:
    """A rank's FLOP rate when `world` ranks share this machine (their mean), and each group size's
    (size, α, β): α the cost of SIZES' small message, β what the large one's extra bytes sent cost
    (a ring all-reduce: collectives.ring_bytes_sent); each the mean over the ranks."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_measure, (world, f"{tmp}/store", out), nprocs=world)
        got = dict(out)
    rate = statistics.fmean(got[("rate", r)] for r in range(world))
    links = []
    for size in (g for g in (2, 4, 8) if g <= world):
        small, large = (statistics.fmean(got[(size, n, r)] for r in range(world)) for n in SIZES)
        extra = ring_bytes_sent("all_reduce", SIZES[1], size) - ring_bytes_sent("all_reduce", SIZES[0], size)
        links.append((size, max(small, 1e-6), extra / max(large - small, 1e-9)))
    return rate, tuple(links)


def measured_step(flags: str, steps: int, tmp: Path) -> tuple[float, dict[str, float]]:
    """train.py under `flags`, one thread a rank: the median step time (steps after WARMUP) and the median
    seconds rank 0 waited on each kind of message (the log's comm_exposed_s)."""
    world = ranks(layout_of(flags))
    log, out = tmp / f"log{abs(hash(flags))}.json", tmp / f"run{abs(hash(flags))}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(Path(__file__).parents[1] / "train.py"), *flags.split(), "--model", HERE["model"],
               "--seq-len", str(HERE["seq_len"]), "--global-batch", str(HERE["global_batch"]),
               "--micro-batch", str(HERE["micro_batch"]), "--steps", str(steps), "--no-wandb",
               "--log-json", str(log), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:  # one line: the run's own error line, else its last (torchrun's), not a traceback here
        lines = done.stderr.strip().splitlines() or ["no output"]
        said = next((line.split("minipar: error: ", 1)[1] for line in lines if "minipar: error: " in line), lines[-1])
        raise SystemExit(f"minipar: error: train.py {flags or '(one rank)'} stopped with exit {done.returncode}: "
                         f"{said}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    timed = [r for r in records if "step_time_s" in r and r["step"] > WARMUP]
    kinds = {k for r in timed for k in r["comm_exposed_s"]}
    return statistics.median(r["step_time_s"] for r in timed), {
        k: statistics.median(r["comm_exposed_s"].get(k, 0.0) for r in timed) for k in sorted(kinds)}


def calibrate(args) -> None:
    layouts = [f.strip() for f in args.calibrate_layouts.split(";")]
    print(f"calibrating the planner's clock: this machine measured, then {len(layouts)} layout(s) predicted and each "
          f"run for {args.calibrate_steps} steps of train.py; minutes (13 layouts: about 5 on 2 cores), a line each",
          flush=True)
    measured = {w: machine_costs(w) for w in sorted({ranks(layout_of(f)) for f in layouts})}
    print(f"this machine: {len(os.sched_getaffinity(0))} cores; one thread a rank, every rank at once")
    for w, (rate, links) in measured.items():
        print(f"  {w} rank{'s' * (w > 1)}: the small model's step {rate / 1e9:.1f} GFLOP/s a rank" + "".join(
            f"; groups of {g}: α {a * 1e3:.2f} ms, β {b / 1e9:.2f} GB/s" for g, a, b in links))
    c, rows = get_config(HERE["model"]), []
    with tempfile.TemporaryDirectory() as tmp:
        for flags in layouts:
            cfg = layout_of(flags)
            rate, links = measured[ranks(cfg)]
            here = Cluster(ranks(cfg), ranks(cfg), flops=rate, mfu=1.0, links=links)
            step, waits = measured_step(flags, args.calibrate_steps, Path(tmp))
            rows.append((flags or "one rank", ranks(cfg), step_time(c, cfg, here), step, waits))
            print(calibration_row(*rows[-1]), flush=True)
    print(calibration_verdict(rows))


def calibration_row(name: str, world: int, predicted: dict, measured: float, waits: dict[str, float]) -> str:
    """A layout's line: the clock's parts, then the measured step and what rank 0 waited on, in ms."""
    parts = " + ".join(f"{k} {v * 1e3:.0f}" for k, v in predicted.items() if k != "total" and v >= 5e-4)
    waited = "".join(f", {k} {v * 1e3:.0f}" for k, v in waits.items() if v >= 5e-4)
    return (f"  {name:<21} {world} rank{'s' * (world > 1)}: predicted {predicted['total'] * 1e3:4.0f} ms ({parts}); "
            f"measured {measured * 1e3:4.0f} ms (waits{waited or ' none'}): {predicted['total'] / measured:.2f}x")


def calibration_verdict(rows: list) -> str:
    """In words: how many layouts the clock puts within 25% of their measured step, and on which
    numbers of ranks it orders the layouts from fastest to slowest as they measured."""
    ratios = [predicted["total"] / measured for _, _, predicted, measured, _ in rows]
    ranked: dict[bool, list[str]] = {True: [], False: []}
    for world in sorted({r[1] for r in rows}):
        mine = [r for r in rows if r[1] == world]
        ranked[sorted(mine, key=lambda r: r[2]["total"]) == sorted(mine, key=lambda r: r[3])].append(str(world))
    said = {ok: " and ".join(worlds) + " rank" + "s" * (worlds != ["1"]) for ok, worlds in ranked.items() if worlds}
    order = ", ".join(f"{'is the measured one' if ok else 'not' if True in said else 'is not the measured one'} on "
                      f"{said[ok]}" for ok in (True, False) if ok in said)
    return (f"verdict: {sum(0.75 <= r <= 1.25 for r in ratios)} of {len(rows)} layouts predicted within 25% of their "
            f"measured step (predicted / measured {min(ratios):.2f}x to {max(ratios):.2f}x: under 1.00x the clock is "
            f"too fast)\nverdict: the predicted order of the layouts, fastest to slowest, {order} (chapter 8 says "
            f"where the clock misses, and why)")


NAMED = {"tiny": "a toy, for tests", "small": "a toy, the CPU default", "1b": "Llama-3.2-1B", "8b": "Llama-3.1-8B",
         "125m": "a toy the size of GPT-2 small, for GPU benchmarks", "70b": "Llama-3.1-70B"}


def sizes() -> None:
    """--sizes: chapter 10's table of the dense named sizes, their parameters counted by num_params()."""
    print("| name | dim | layers | heads / kv heads | ffn | vocab | parameters | what it is |\n" + "| --- " * 8 + "|")
    for name in ("tiny", "small", "125m", "1b", "8b", "70b"):
        c, what = get_config(name), NAMED[name]
        n = c.num_params()
        count = f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"
        if c.rope_factor != 1:  # Llama 3's RoPE scaling
            what += f": {'tied embeddings, ' * c.tie_embeddings}RoPE θ {c.rope_theta:g} scaled ×{c.rope_factor:g}"
        print(f"| {name} | {c.dim} | {c.n_layers} | {c.n_heads} / {c.n_kv_heads} | {c.ffn_dim} | {c.vocab_size} | "
              f"{count} | {what} |")


def main(argv=None) -> None:
    with refusals():  # a flag out of its range, or a layout the planner refuses: one line
        args = parse_args(argv)
    if args.sizes:
        return sizes()
    with refusals():
        if args.calibrate:
            layouts = [layout_of(f.strip()) for f in args.calibrate_layouts.split(";")]
            for cfg in layouts:
                cfg.validate(ranks(cfg))  # before anything is measured
            if len(set(map(repr, layouts))) < len(layouts):  # a second run would find the first one's files
                raise InputError(f"--calibrate-layouts {args.calibrate_layouts!r} names a layout twice: give each once")
            if not WARMUP < args.calibrate_steps <= MAX_CALIBRATE_STEPS:
                raise InputError(f"--calibrate-steps {args.calibrate_steps}: give more than {WARMUP} (the first "
                                 f"{WARMUP} steps of each run are not measured), at most {MAX_CALIBRATE_STEPS}")
    if args.calibrate:
        return calibrate(args)
    with refusals():
        if args.seq_len > get_config(args.model).max_seq_len:  # as train.py refuses it
            raise InputError(f"--seq-len {args.seq_len} is above --model {args.model}'s max_seq_len "
                             f"{get_config(args.model).max_seq_len}: give {get_config(args.model).max_seq_len} or less")
        cluster = Cluster(args.gpus, args.gpus_per_node, args.gpu_memory, args.peak_tflops * 1e12, args.mfu,
                          args.intra_gbps * 1e9, args.inter_gbps * 1e9, headroom=args.headroom)
        optimizers = ("adamw", "muon") if args.optimizer == "both" else (args.optimizer,)
        fits, too_big = plan(args.model, cluster, args.seq_len, args.global_batch, args.micro_batch, optimizers)
    c = get_config(args.model)
    print(f"{args.model}: {c.num_params() / 1e9:.2f}B parameters on {args.gpus} GPUs ({args.gpus_per_node} per "
          f"node, {cluster.memory / 1e9:.0f} GB each, {cluster.usable / 1e9:.1f} GB of it usable: {args.headroom:.0%} "
          f"headroom), seq {args.seq_len}, global batch {args.global_batch}")
    print(f"{len(fits)} layouts fit, {too_big} do not. Fastest first (time per optimizer step; memory of the "
          f"fullest rank):")
    if not fits:
        print("  none: use more GPUs, a shorter --seq-len or a smaller --micro-batch")
        return
    width = max(len(choice.flags()) for choice in fits[: args.top])  # the flags' column
    for choice in fits[: args.top]:
        print(row(choice, width))
    best = fits[0]
    ideal = step_time(c, best.cfg, cluster)["compute"]
    print(f"\nThe choice: {best.flags()}. Its step is {best.time['total'] / ideal:.3f}x the pure compute time; "
          f"what the others would cost instead:")
    print("\n".join(why_not(best, fits, args, cluster)))


if __name__ == "__main__":
    main()
