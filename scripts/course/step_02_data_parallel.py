"""Step 2: data parallelism gives the single-device gradient, for one all-reduce per step.

    .venv/bin/torchrun --nproc-per-node 2 scripts/course/step_02_data_parallel.py     (4 works too)

On one fixed global batch of 16 sequences, with the tiny Llama in float64, it shows:

(a) the gradient of one device on the whole batch next to each dp rank's local gradient (its 1/N
    of the batch) and the averaged gradient `DataParallel` leaves after `finish_grad_sync()`;
(b) the traffic of one optimizer step with gradient accumulation over 4 micro-batches, from the
    mesh's ledger: with `no_sync()` one all-reduce of every gradient, without it four; next to
    the formulas Psi*8 bytes of payload and 2(N-1)/N * Psi*8 bytes sent per rank;
(c) the gradient buckets, and how many of their all-reduces started during backward.

Chapter: docs/02_data_parallel.md.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist
from course_common import finish, leave, say, start_gloo

from minipar.data_parallel import DataParallel
from minipar.mesh import Mesh
from minipar.model import Llama, get_config

GLOBAL_BATCH, SEQ, ACCUM = 16, 16, 4
SHOWN = ["lm_head.weight", "layers.1.mlp.w_down.weight", "layers.0.attn.wq.weight", "norm.weight"]


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)  # [B, s]
    return x, torch.roll(x, -1, dims=1)  # targets: the next token


def new_model() -> Llama:
    return Llama(get_config("tiny"), seed=0).double()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def vals(t: torch.Tensor) -> str:
    return " ".join(f"{v:+.4e}" for v in t.reshape(-1)[:3].tolist())


def my_rows(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rank, rows = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]  # [B/N, s]


def part_a(mesh: Mesh, dp_model: DataParallel, x, y) -> tuple[dict | None, int]:
    """(a) One backward on every rank's rows, then the average. Returns the single-device gradient
    (rank 0; None elsewhere) and how many all-reduces started during backward, for (b) and (c)."""
    world, model = mesh.groups().dp.size, dp_model.module
    rows = GLOBAL_BATCH // world
    mesh.ledger.reset()
    dp_model(*my_rows(x, y)).backward()
    launched_in_backward = mesh.ledger.get("dp", "all_reduce").calls  # for (c)
    local = grads(model)  # the buckets are in flight, but .grad still holds this rank's own gradient
    dp_model.finish_grad_sync()
    averaged = grads(model)
    every_local = [None] * world
    every_averaged = [None] * world
    dist.all_gather_object(every_local, {n: local[n] for n in SHOWN})
    dist.all_gather_object(every_averaged, averaged)
    if dist.get_rank() != 0:
        return None, launched_in_backward

    single = new_model()
    single(x, y).backward()  # the plain computation: one device, the whole batch
    reference = grads(single)
    print(f"\n(a) gradients: one device on all {GLOBAL_BATCH} rows vs dp = {world} ({rows} rows each)")
    for n in SHOWN:
        print(f"  {n}  {tuple(reference[n].shape)}, first values")
        print(f"    {'single device, all rows':<28}{vals(reference[n])}")
        for r in range(world):
            print(f"    {f'rank {r} local, its {rows} rows':<28}{vals(every_local[r][n])}")
        print(f"    {'dp average (every rank)':<28}{vals(averaged[n])}")
        diff = (reference[n] - averaged[n]).abs().max().item()
        print(f"    max |single - dp| over the tensor: {diff:.1e}")
    psi = sum(p.numel() for p in model.parameters())
    print(f"  max |single - dp| over all {psi:,} gradient entries: {max_diff(reference, averaged):.1e}")
    spread = max(max_diff(every_averaged[0], g) for g in every_averaged)
    print(f"  max difference between the ranks' averaged gradients: {spread:.1e} (replicas stay equal)")
    return reference, launched_in_backward


def one_step(mesh: Mesh, dp_model: DataParallel, micro: list, use_no_sync: bool) -> dict[str, torch.Tensor]:
    """The gradient part of train_step (minipar/run/train.py), without the optimizer."""
    dp_model.module.zero_grad(set_to_none=True)
    mesh.ledger.reset()
    for i, (mx, my) in enumerate(micro):
        # no_sync: accumulate locally, only the last backward all-reduces. Without it, every
        # backward all-reduces, and finish_grad_sync must follow each one (see the chapter).
        with dp_model.no_sync() if use_no_sync and i < ACCUM - 1 else nullcontext():
            (dp_model(mx, my) / ACCUM).backward()
        if not use_no_sync or i == ACCUM - 1:
            dp_model.finish_grad_sync()
    return grads(dp_model.module)


def part_b(mesh: Mesh, dp_model: DataParallel, x, y, reference: dict | None) -> None:
    """(b) The traffic of one optimizer step over ACCUM micro-batches, with and without no_sync."""
    x_local, y_local = my_rows(x, y)
    micro = list(zip(x_local.chunk(ACCUM), y_local.chunk(ACCUM), strict=True))  # ACCUM x [B/N/ACCUM, s]
    with_no_sync = one_step(mesh, dp_model, micro, use_no_sync=True)
    e1 = mesh.ledger.get("dp", "all_reduce")
    without = one_step(mesh, dp_model, micro, use_no_sync=False)
    e4 = mesh.ledger.get("dp", "all_reduce")
    world = mesh.groups().dp.size
    S, nb = sum(p.numel() for p in dp_model.module.parameters()) * 8, len(dp_model.buckets)
    sent = 2 * (world - 1) / world * S
    say(f"\n(b) one optimizer step, {ACCUM} micro-batches per rank; ledger 'dp/all_reduce' on rank 0")
    say(f"  {'':<40}{'calls':>6}{'payload bytes':>15}{'sent bytes':>13}")
    table = [
        ("ledger, with no_sync", e1.calls, e1.bytes, e1.sent),
        ("formula: buckets, Psi*8, 2(N-1)/N*Psi*8", nb, S, sent),
        ("ledger, sync every micro-batch", e4.calls, e4.bytes, e4.sent),
        (f"formula: {ACCUM} x the above", ACCUM * nb, ACCUM * S, ACCUM * sent),
    ]
    for label, calls, payload, sent_bytes in table:
        say(f"  {label:<40}{calls:>6}{payload:>15,}{sent_bytes:>13,.0f}")
    if reference is not None:
        print(f"  max |no_sync - sync every micro-batch| gradient: {max_diff(with_no_sync, without):.1e}")
        print(f"  max |no_sync - single device| gradient:          {max_diff(with_no_sync, reference):.1e}")


def part_c(dp_model: DataParallel, launched_in_backward: int) -> None:
    """(c) The buckets, and how many of their all-reduces backward itself started."""
    names = {id(p): n for n, p in dp_model.module.named_parameters()}
    nb = len(dp_model.buckets)
    say(f"\n(c) {nb} gradient buckets of ~0.05 MiB, filled from the last parameter to the first:")
    for b in dp_model.buckets:
        size = sum(p.numel() for p in b.params) * 8
        first, last = names[id(b.params[0])], names[id(b.params[-1])]
        say(f"  bucket {b.index}: {len(b.params):>2} params, {size:>7,} bytes   {first} .. {last}")
    say(
        f"  all-reduces started during backward: {launched_in_backward} of {nb}; "
        f"left for finish_grad_sync to start: {nb - launched_in_backward}"
    )


def main() -> None:
    start_gloo()
    world = dist.get_world_size()
    mesh = Mesh.build(dp=world)
    x, y = global_batch()
    if GLOBAL_BATCH % (world * ACCUM):
        raise SystemExit(f"{GLOBAL_BATCH} rows do not split into {world} ranks x {ACCUM} micro-batches")
    model = new_model()
    dp_model = DataParallel(model, mesh.groups(), bucket_mb=0.05)  # small buckets: several of them
    psi = sum(p.numel() for p in model.parameters())
    say(
        f"tiny Llama, float64: Psi = {psi:,} parameters = {psi * 8:,} bytes of gradient; dp = {world}; "
        f"global batch {GLOBAL_BATCH} x {SEQ} tokens, {GLOBAL_BATCH // world} rows per rank"
    )
    reference, launched_in_backward = part_a(mesh, dp_model, x, y)
    part_b(mesh, dp_model, x, y, reference)
    part_c(dp_model, launched_in_backward)
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
