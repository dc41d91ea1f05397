"""Step 9: all four dimensions at once, seen from every rank: dp 2 x tp 2 x pp 2 x cp 2, with sp and ZeRO-1.

    .venv/bin/torchrun --standalone --nproc-per-node 16 scripts/course/step_09_4d.py     (a few minutes on a laptop)

(a) the mesh: which 16 ranks form each group, and each rank's coordinates;
(b) one training step of the `small` model's shape (4 layers: 2 per stage) with a 256-word vocabulary,
    in float64, its loss against one process running the plain model on the whole batch;
(c) per rank: the bytes it holds (weights, gradients, optimizer state: measured on its tensors, and
    estimated on the meta device) and the bytes it sent in the step, group by group (measured by
    the ledger, and estimated by traffic.bytes_sent);
(d) the same 16 ranks under other layouts, by estimate alone: the fullest rank's memory and what
    each group sends per step.

Chapter: docs/09_4d.md.
"""

from functools import partial

import torch
import torch.distributed as dist
from course_common import each_rank, leave, say, start_gloo, to_rank0

from minipar.context_parallel import split_sequence
from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw, build_grad_sync
from minipar.planning.estimate import held_bytes, peak_bytes
from minipar.planning.traffic import bytes_sent
from minipar.run.config import TrainConfig
from minipar.run.train import build_model, train_step

LAYOUT = dict(dp=2, tp=2, pp=2, cp=2, sp=True, zero=1)
CFG = TrainConfig(model="small", seq_len=32, global_batch=8, micro_batch=2, dtype="float64", **LAYOUT)
MODEL = get_config("small", vocab_size=256)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (CFG.global_batch, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def part_a(mesh: Mesh) -> None:
    say("(a) the mesh (tp varies fastest, then cp, dp, pp):")
    say(mesh.layout.table())
    names = ("tp", "cp", "dp", "pp", "dp_cp")
    each_rank("    groups of each rank:", "  ".join(f"{n} {mesh.group(*n.split('_')).ranks}" for n in names))


def part_b(mesh: Mesh):
    model, pipeline = build_model(CFG, mesh, MODEL, torch.device("cpu"), torch.float64)
    wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, CFG), partial(adamw, lr=CFG.lr),
                              zero=CFG.zero, bucket_mb=CFG.bucket_mb, offload=CFG.offload)
    x, y = batch()
    per = CFG.global_batch // CFG.dp
    x, y = (split_sequence(t[mesh.coord("dp") * per:(mesh.coord("dp") + 1) * per], mesh.groups().cp) for t in (x, y))
    micro = list(zip(x.split(CFG.micro_batch), y.split(CFG.micro_batch)))
    mesh.ledger.reset()
    loss, norm = train_step(wrapper, micro, 1.0, pipeline=pipeline)
    sent = {k: v["sent"] for k, v in mesh.ledger.snapshot().items() if v["sent"]}
    losses = to_rank0((loss, pipeline.holds_last()))
    if losses is not None:
        mine = [value for value, last in losses if last]
        plain = Llama(MODEL, seed=0).double()
        with torch.no_grad():
            reference = float(plain(*batch()))
        print(f"\n(b) one step: the loss, averaged over the ranks of the last stage, {sum(mine) / len(mine):.12f}; "
              f"one process, plain model, whole batch: {reference:.12f}; gradient norm {norm:.6f}")
    return wrapper, pipeline, micro, sent


def part_c(mesh: Mesh, wrapper, pipeline, micro, sent) -> None:
    with wrapper.no_sync():  # a second backward, measured once its gradients are synced
        pipeline.run(wrapper.module, micro, 1.0)
    wrapper.finish_grad_sync()
    measured, estimated = wrapper.held_bytes(), held_bytes(MODEL, CFG, pipeline.group.rank)
    each_rank("\n(c) bytes held once a step's gradients are synced (weights, gradients, optimizer)",
              f"pp{mesh.coord('pp')} dp{mesh.coord('dp')} cp{mesh.coord('cp')} tp{mesh.coord('tp')}  "
              + " ".join(f"{k} {v:,}" for k, v in measured.items()) + f"   estimate equal: {measured == estimated}")
    each_rank("    bytes sent in the step, by group/op (ledger; estimate equal?)",
              ", ".join(f"{k} {v:,}" for k, v in sorted(sent.items()))
              + f"   equal: {sent == bytes_sent(MODEL, CFG, pipeline.group.rank)}")


def part_d() -> None:
    say("\n(d) the same 16 ranks, other layouts, by estimate (the small shape with a 256-word vocabulary, "
        "float64, 16 x 32 tokens per step, one row per micro-batch):")
    say(f"  {'layout':<42} {'fullest rank':>12}   bytes sent per step by pp rank 0, per group")
    for layout in (dict(dp=16), dict(dp=16, zero=3), dict(dp=8, tp=2, sp=True), dict(dp=4, tp=2, pp=2, sp=True),
                   dict(dp=2, tp=2, pp=2, cp=2, sp=True, zero=1), dict(dp=1, tp=4, pp=2, cp=2, sp=True)):
        cfg = TrainConfig(model="small", seq_len=32, global_batch=16, micro_batch=1, dtype="float64", **layout)
        cfg.validate(16)
        groups = {}
        for key, value in bytes_sent(MODEL, cfg).items():
            groups[key.split("/")[0]] = groups.get(key.split("/")[0], 0) + value
        flags = " ".join(f"--{k} {v}" if v is not True else f"--{k}" for k, v in layout.items())
        say(f"  {flags:<42} {peak_bytes(MODEL, cfg) / 2**20:>9,.2f} MiB   "
            + ", ".join(f"{g} {v / 2**20:,.2f} MiB" for g, v in groups.items()))


def main() -> None:
    start_gloo()
    if dist.get_world_size() != 16:
        raise SystemExit("step_09_4d.py: run it on 16 ranks: torchrun --standalone --nproc-per-node 16 ...")
    mesh = Mesh.build(dp=2, tp=2, pp=2, cp=2)
    part_a(mesh)
    part_c(mesh, *part_b(mesh))
    if dist.get_rank() == 0:
        part_d()
    dist.barrier()
    mesh.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave()
