"""What the course scripts share: starting a run on CPU ranks, and printing from all of them.

Every step_0N script runs on a few gloo ranks on one machine, and every rank has something to
show. Ranks that printed for themselves would interleave their lines at random, so rank 0 prints
everything: `say` what it knows itself, `each_rank` one line gathered from every rank, in rank
order, and `to_rank0` gathers any object for it to print from.

Not a script: the course scripts import it (`scripts/course/` is on sys.path when one of them runs).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def start_gloo() -> None:
    if "RANK" not in os.environ:  # run with plain python: no ranks to meet, and torch's error is a traceback
        doc = sys.modules["__main__"].__doc__ or ""
        how = next((line.split("(")[0].strip() for line in doc.splitlines() if "torchrun" in line),
                   f".venv/bin/torchrun --standalone --nproc-per-node 2 {sys.argv[0]}")
        print(f"{Path(sys.argv[0]).name} runs on several ranks: launch it with torchrun, e.g. {how}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)  # several ranks share a few CPU cores
    dist.init_process_group("gloo")  # rank and world size come from torchrun's environment


def finish(mesh) -> None:
    # Leave together: a rank that tears down its groups while another still works (rank 0 alone
    # computing a reference) can make gloo abort the process as the connections close.
    dist.barrier()
    mesh.destroy()
    dist.destroy_process_group()


def leave() -> None:
    """End the script now, its output flushed, without tearing down torch's C++ objects at interpreter exit,
    as scripts/train.py does: once in a few hundred runs a process group's thread is destroyed there unjoined
    ("terminate called without an active exception") and a script that printed everything would exit -6."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def say(*args) -> None:
    """print, on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args)


def to_rank0(obj) -> list | None:
    """Gather one Python object from every rank; rank 0 gets the list in rank order, others None."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def each_rank(title: str, line: str) -> None:
    """Gather one line from every rank; rank 0 prints them in rank order, under the title if any."""
    lines = to_rank0(line)
    if lines is not None:
        if title:
            print(title)
        print("\n".join(f"  rank {r}: {text}" for r, text in enumerate(lines)))


def runs(numbers: list[int]) -> str:
    """[0..3, 12..15]: the runs of consecutive numbers, in the given order (token positions)."""
    out, start = [], 0
    for i in range(1, len(numbers) + 1):
        if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
            out.append(f"{numbers[start]}..{numbers[i - 1]}" if i - 1 > start else f"{numbers[start]}")
            start = i
    return "[" + ", ".join(out) + "]"
