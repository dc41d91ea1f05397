"""Which layout should I run? Every layout of the GPUs that fits, fastest first, with the reasons.

    .venv/bin/python scripts/plan.py --model 8b --gpus 64 --gpus-per-node 8 --gpu-memory 80GB \
        --seq-len 8192 --global-batch 1024

Memory is minipar's own estimate (minipar/planning/estimate.py, checked byte for byte against real ranks);
time is the stated model of minipar/planning/planner.py (compute at --mfu of --peak-tflops, communication
at the given bandwidths). A layout fits when its fullest rank stays within --gpu-memory less --headroom.
Nothing runs on a GPU: it is arithmetic, for any number of GPUs. A flag out of its range is one line and
exit code 2 (minipar/run/args.py).
"""

import argparse

from minipar.model import CONFIGS, get_config
from minipar.planning.planner import HEADROOM, Cluster, plan, step_time
from minipar.run.args import (
    HelpFormatter,
    InputError,
    Parser,
    byte_size,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    refusals,
)


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
    p.add_argument("--top", type=positive_int, default=8, help="how many layouts to list")
    return p.parse_args(argv)


def row(choice, width: int) -> str:
    t = choice.time
    return (f"  {choice.flags():<{width}} {t['total']:>9.2f} s = compute {t['compute']:.2f} + tp {t['tp']:.2f} + "
            f"cp {t['cp']:.2f} + pp {t['pp']:.2f} + dp {t['dp']:.2f} + bubble {t['bubble']:.2f}   "
            f"{choice.memory / 1e9:5.1f} GB")


def recomputes(cfg) -> bool:
    return cfg.recompute or cfg.recompute_mlp


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
              "recompute of the MLPs only (selective)": lambda x: x.recompute_mlp}
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


def main(argv=None) -> None:
    with refusals():  # a flag out of its range, or a layout the planner refuses: one line
        args = parse_args(argv)
        if args.seq_len > get_config(args.model).max_seq_len:  # as train.py refuses it
            raise InputError(f"--seq-len {args.seq_len} is above --model {args.model}'s max_seq_len "
                             f"{get_config(args.model).max_seq_len}: give {get_config(args.model).max_seq_len} or less")
        cluster = Cluster(args.gpus, args.gpus_per_node, args.gpu_memory, args.peak_tflops * 1e12, args.mfu,
                          args.intra_gbps * 1e9, args.inter_gbps * 1e9, headroom=args.headroom)
        fits, too_big = plan(args.model, cluster, args.seq_len, args.global_batch, args.micro_batch)
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
