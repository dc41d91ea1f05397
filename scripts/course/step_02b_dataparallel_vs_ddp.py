"""Step 2b: nn.DataParallel's pattern against DDP's, on the same step: the same gradient, other traffic.

    .venv/bin/torchrun --nproc-per-node 2 scripts/course/step_02b_dataparallel_vs_ddp.py     (4 works too)

torch.nn.DataParallel needs CUDA devices, so its pattern is *simulated* here, in rank 0's one
process on the CPU: N copies of the model stand for the N devices, and each of its four moves
is written out in a line (scatter the batch, replicate the module, gather the outputs onto
device 0, reduce the replicas' gradients onto device 0). The bytes it prints are the sizes of
the tensors that change device in those lines, assuming each copy goes straight between device
0 and the other device (on CUDA, torch uses NCCL's broadcast and reduce for the weights, which
pass them along a chain instead: the same total over all links, but device 0 itself sends and
receives one copy each way instead of N-1). Nothing is timed: one process driving N devices
also runs every replica's Python under one GIL, which this simulation cannot show.

DDP's side is real: minipar's DataParallel on N gloo ranks, one process each, its all-reduce
bytes read from the mesh's ledger. Both are compared with one device on the whole batch.

Chapter: docs/02_data_parallel.md.
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import finish, leave, say, start_gloo

from minipar.data_parallel import DataParallel
from minipar.mesh import Mesh
from minipar.model import Llama, get_config

BATCH, SEQ = 8, 16
CFG = get_config("tiny")


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1234))
    return x, torch.roll(x, -1, dims=1)  # [B, s]; targets: the next token


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def max_diff(a, b) -> float:
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def data_parallel_step(model: Llama, x, y, n: int) -> dict[str, tuple[int, int]]:
    """One step of nn.DataParallel's pattern on n simulated devices; model (on device 0) ends with
    the gradient. Returns {move: (bytes device 0 sends, bytes it receives)}."""
    chunks = x.chunk(n)  # scatter: device 0 cuts the batch, row block i goes to device i
    replicas = [copy.deepcopy(model) for _ in range(n)]  # replicate: every step, device 0 -> each device
    outputs = [replica(c) for replica, c in zip(replicas, chunks)]  # parallel_apply: n threads in torch
    for o in outputs:
        o.retain_grad()
    logits = torch.cat(outputs)  # gather: every replica's output onto device 0, [B, s, V]
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # on device 0, over the whole batch
    loss.backward()  # the logits' gradient goes back to each device (cat's backward: a scatter)
    for p, *copies in zip(model.parameters(), *(r.parameters() for r in replicas)):
        p.grad = sum(c.grad for c in copies)  # reduce: every replica's gradient summed onto device 0
    others = slice(1, None)  # what changes device: everything of the devices other than 0
    weights = [p for r in replicas[others] for p in r.parameters()]
    return {"scatter the batch": (nbytes(*chunks[others]), 0),
            "replicate the module": (nbytes(*weights), 0),
            "gather the outputs": (0, nbytes(*outputs[others])),
            "outputs' gradients back": (nbytes(*(o.grad for o in outputs[others])), 0),
            "reduce the gradients": (0, nbytes(*(p.grad for p in weights)))}


def main() -> None:
    start_gloo()
    n = dist.get_world_size()
    mesh = Mesh.build(dp=n)
    x, y = global_batch()
    single = Llama(CFG, seed=0).double()
    single(x, y).backward()  # the plain computation: one device, the whole batch
    psi = sum(p.numel() for p in single.parameters())
    logits = BATCH * SEQ * CFG.vocab_size * 8
    say(f"tiny Llama, float64: Psi = {psi:,} parameters ({psi * 8:,} B); batch {BATCH} x {SEQ} tokens; "
        f"N = {n} devices; the logits [B, s, V] are {logits:,} B")

    ddp = DataParallel(Llama(CFG, seed=0).double(), mesh.groups())  # one process per rank, its rows
    rows = slice(mesh.coord("dp") * BATCH // n, (mesh.coord("dp") + 1) * BATCH // n)
    mesh.ledger.reset()
    ddp(x[rows], y[rows]).backward()  # the all-reduces start in backward, bucket by bucket
    ddp.finish_grad_sync()
    sent = mesh.ledger.get("dp", "all_reduce").sent
    diffs = [None] * n
    dist.all_gather_object(diffs, max_diff(ddp.module, single))
    if mesh.coord("dp") == 0:
        simulated = Llama(CFG, seed=0).double()
        moves = data_parallel_step(simulated, x, y, n)
        print("\n(a) nn.DataParallel's pattern, simulated in one process: bytes through device 0 in one step")
        for move, (out, into) in moves.items():
            print(f"  {move:<26}sends {out:>10,} B   receives {into:>10,} B")
        total = sum(out + into for out, into in moves.values())
        formula = 2 * (n - 1) * psi * 8 + 2 * (n - 1) * logits // n + (n - 1) * BATCH * SEQ * 8 // n
        print(f"  {'total':<26}{total:>16,} B")
        print(f"  = 2 (N-1) x Psi x 8 (weights out, gradients in) + 2 (N-1)/N x logits (out and back) "
              f"+ (N-1)/N x tokens = {formula:,} B")
        print(f"  max |DataParallel - one device| over every gradient: {max_diff(simulated, single):.1e}")
        print(f"  device 0 also holds all {BATCH} rows' logits and the loss over them; device i > 0 holds "
              f"{BATCH // n} rows' logits")
        print(f"\n(b) DDP: minipar's DataParallel, {n} processes, gloo; ledger 'dp/all_reduce' on rank 0")
        print(f"  every rank sends {sent:,} B = 2 (N-1)/N x Psi x 8 = {2 * (n - 1) * psi * 8 // n:,} B, "
              f"and receives as much; nothing else moves")
        print("  max |DDP - one device| over every gradient, per rank: "
              + "  ".join(f"{d:.1e}" for d in diffs))
        print(f"  device 0's traffic, DataParallel / DDP: {total / (2 * sent):.1f}x")
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
