"""Exercise 4c.1 (chapter 4c): Muon's step with one owner per matrix (Moonlight's distributed Muon).

ZeRO cuts a flat vector of matrices anywhere, so a rank's slice holds pieces of matrices, and Muon's
Newton-Schulz needs each matrix whole. Here the flat vector holds the matrices of `shapes` one after
another (then zeros, to a multiple of N numbers P); rank r holds numbers [r P/N, (r+1) P/N). Each
matrix i has one owner, `owner[i]` (balanced by Newton-Schulz FLOPs). Write the step:

    1. one all-to-all: every rank sends each owner the part of the owner's matrices its slice holds
    2. each owner puts its matrices together whole and orthogonalises each: newton_schulz(m, 5)
    3. a second all-to-all: each owner sends every rank the part of its slice of those matrices

Return this rank's slice [P/N] of the orthogonalised vector (each matrix's newton_schulz, padding
0). It must equal one device's (Newton-Schulz of each whole matrix) exactly: Newton-Schulz runs in
bf16, so send the numbers in bf16 (what it reads), 2 bytes each.

What it must send, as the checker reads the ledger: exactly two all-to-alls, and per rank 2 bytes
for each number of its slice in a matrix another rank owns, plus 2 for each number of a matrix it
owns that lies in another rank's slice. Orthogonalising each rank's pieces alone is another
optimizer (the result differs); all-gathering everything to everyone gives the right numbers but
sends each rank every matrix (the ledger says so).

Useful: `minipar.collectives.all_to_all(t, group, send_splits=[...], recv_splits=[...])` (piece j
of t to rank j, the pieces received concatenated in rank order), `group.rank`, `group.size`,
`minipar.muon.newton_schulz`.

The library's own, after you tried: `Muon.owner_pieces` in minipar/muon.py.

Check: make exercise N=4c.1 (2 and 4 ranks, a few seconds)
"""

import torch

from minipar.collectives import Group, all_to_all  # noqa: F401 - yours to use
from minipar.muon import newton_schulz  # noqa: F401 - yours to use


def owner_step(mine: torch.Tensor, shapes: list[tuple[int, int]], owner: list[int], group: Group) -> torch.Tensor:
    """mine: [P/N] this rank's slice; shapes[i], owner[i]: matrix i's shape and the rank that orthogonalises
    it. Returns this rank's slice [P/N] of the orthogonalised matrices."""
    raise NotImplementedError("hint: for each rank j, list (matrix, range of the flat vector) of what goes to j; "
                              "the sizes are the all-to-all's send_splits")
