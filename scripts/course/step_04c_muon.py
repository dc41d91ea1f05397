"""Step 4c: Muon under ZeRO-1, three ways: which matrices each rank orthogonalises, what it sends for them.

    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_04c_muon.py    (2 works too)

All ranks form one dp group. The tiny Llama (seed 1, float64) takes one Muon step on a fixed batch
under ZeRO-1 with small buckets (0.02 MiB: slices cut through matrices), once per --muon-method:

(a) per rank, the Muon matrices it orthogonalises (recorded as its optimizer runs) and their
    Newton-Schulz FLOPs: gather, every matrix its slice touches; owner, the matrices it owns
    (balanced by FLOPs); whole, the matrices of its slices, which end between matrices;
(b) per rank, the ledger's Muon messages (gather: the all-gather beyond ZeRO's own weights; owner:
    the two all-to-alls; whole: none) next to the estimator's formula (planning/estimate_muon.py),
    and whether every dp byte of the step equals the estimate;
(c) the largest weight difference between the methods: one optimizer, three ways to run it;
(d) from the estimator alone, Llama 8B on 64 GPUs (bf16-mixed, ZeRO-1, 25 MiB buckets): each method's
    optimizer state, Muon's extra bytes sent and Newton-Schulz FLOPs on the busiest rank.

Chapter: docs/04c_muon.md.
"""

import torch
import torch.distributed as dist
from course_common import each_rank, finish, leave, say, start_gloo

from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.muon import ns_flops, whole_shape
from minipar.parallelize import build_grad_sync, optimizer_of
from minipar.planning.estimate import held_bytes, rank_model, zero_buckets
from minipar.planning.estimate_muon import muon_messages, muon_work, ns_flops_per_rank
from minipar.planning.traffic import bytes_sent
from minipar.run.config import TrainConfig
from minipar.run.train import build_model, train_step
from minipar.zero import kept_whole

CFG = get_config("tiny")
ROWS, SEQ, BUCKET_MB = 8, 32, 0.02
METHODS = ("gather", "owner", "whole")


def one_step(mesh: Mesh, cfg: TrainConfig):
    """One Muon step under cfg: (the names of the matrices this rank orthogonalised, its ledger, its weights)."""
    model, _ = build_model(cfg, mesh, CFG, torch.device("cpu"), torch.float64)
    groups = mesh.groups()
    wrapper = build_grad_sync(model, groups, *optimizer_of(model, cfg, groups), zero=cfg.zero, bucket_mb=BUCKET_MB)
    names, done = {id(p): n for n, p in model.named_parameters()}, []
    optimizer, plain = wrapper.optimizer, wrapper.optimizer.orthogonalised

    def recorded(local, q, steps):  # the optimizer's own orthogonalised, noting whose matrix it is
        done.append(q)
        return plain(local, q, steps)

    optimizer.orthogonalised = recorded
    per, r = ROWS // groups.dp.size, groups.dp.rank
    x = torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    x = x[r * per : (r + 1) * per]  # [ROWS/N, SEQ]: this rank's rows
    mesh.ledger.reset()
    train_step(wrapper, [(x, torch.roll(x, -1, dims=1))], cfg.grad_clip)
    ledger, n = mesh.ledger.snapshot(), groups.dp.size
    # ZeRO-1's own messages: the weights' all-gather, 8 bytes a number, (N-1)/N of each bucket sent
    zero_gather = sum((n - 1) * b.padded * 8 // n for b in wrapper.buckets)
    muon = ledger.get("dp/all_gather", {}).get("sent", 0) - zero_gather + ledger.get("dp/all_to_all", {}).get("sent", 0)
    with wrapper.gathered():
        weights = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    sent = {k: v["sent"] for k, v in ledger.items() if v["sent"]}
    return [names[id(q)] for q in done], done, muon, sent, weights


def main() -> None:
    start_gloo()
    n = dist.get_world_size()
    with Mesh.build(dp=n) as mesh:
        say(f"tiny Llama, float64, Muon (5 Newton-Schulz steps, bf16) on its {7 * CFG.n_layers} block matrices; "
            f"dp = {n}, ZeRO-1, buckets of {BUCKET_MB} MiB\n")
        final = {}
        for method in METHODS:
            cfg = TrainConfig(model="tiny", dp=n, zero=1, optimizer="muon", muon_method=method, dtype="float64",
                              seq_len=SEQ, global_batch=ROWS, micro_batch=ROWS // n, bucket_mb=BUCKET_MB)
            names, done, measured, sent, final[method] = one_step(mesh, cfg)
            flops = sum(ns_flops(whole_shape(q), cfg.muon_ns_steps) for q in done)
            short = ", ".join(name.removeprefix("layers.").removesuffix(".weight") for name in names)
            say(f"--muon-method {method}")
            each_rank("(a) the matrices it orthogonalises, and their Newton-Schulz FLOPs",
                      f"{len(names):>2} ({flops / 1e6:,.1f} MFLOP): {short}")
            paper = rank_model(CFG, cfg)
            _, muon = muon_work(paper, cfg, zero_buckets(paper, cfg), mesh.coord("dp"))
            estimate = bytes_sent(CFG, cfg, 0, mesh.coord("dp"))
            there, back = sum(b for _, b in muon[::2]), sum(b for _, b in muon[1::2])  # owner: there, back
            formula = {"gather": f"one bf16 all-gather a cut bucket, {there + back:,}",
                       "owner": f"to the owners {there:,} + back {back:,}", "whole": "nothing"}[method]
            each_rank("(b) Muon's bytes sent: the ledger's (beyond ZeRO's own), the formula's; every byte = estimate?",
                      f"{measured:>7,} (formula: {formula}); {sent == estimate}")
            say("")
        worst = max(float((final[m] - final["gather"]).abs().max()) for m in METHODS)
        say(f"(c) the largest weight difference between the three methods after the step: {worst:.1e}")
        sizes = [q.numel() for q in Llama(CFG, seed=0).layers["0"].parameters() if q.dim() == 2]  # a layer's 7
        takes = " and ".join(f"{kept_whole(sizes, k)[1]:,} over {k} ranks" for k in (2, 4))
        say(f"    whole's uneven slices (kept_whole): one layer's {len(sizes)} matrices, {sum(sizes):,} numbers, "
            f"take {takes}\n")
        if dist.get_rank() == 0:
            at_scale()
        finish(mesh)


def at_scale() -> None:
    """(d): the estimator's figures for 8B on 64 GPUs, per rank (the busiest where ranks differ)."""
    c = get_config("8b")
    print("(d) Llama 8B on 64 GPUs, bf16-mixed, ZeRO-1: per rank, GiB and TFLOP a step (the busiest rank)")
    print(f"  {'layout':<14} {'method':<7} {'optimizer':>10} {'Muon sends':>11} {'NS TFLOP':>9} {'NS, all':>8}")
    for dp, tp in ((64, 1), (8, 8)):
        for method in ("adamw", *METHODS):
            cfg = TrainConfig(model="8b", dp=dp, tp=tp, sp=tp > 1, zero=1, precision="bf16-mixed", seq_len=4096,
                              global_batch=dp, micro_batch=1, optimizer="adamw" if method == "adamw" else "muon",
                              muon_method="gather" if method == "adamw" else method)
            paper = rank_model(c, cfg)
            sent = sum(b for _, b in muon_messages(paper, cfg, zero_buckets(paper, cfg)))
            flops = ns_flops_per_rank(c, cfg)
            print(f"  {f'dp {dp} x tp {tp}':<14} {method:<7} {held_bytes(c, cfg)['optimizer'] / 2**30:>10.2f} "
                  f"{sent / 2**30:>11.2f} {max(flops) / 1e12:>9.2f} {sum(flops) / 1e12:>8.1f}")


if __name__ == "__main__":
    main()
    leave()
