"""Batches, from token files: documents, the held-out ones, windows, a seeded order.

Documents. Each text file is a document ended by <|endoftext|> (and each part of one that the
text itself separates with <|endoftext|>); a token file's documents end at that token's id when
--tokenizer names it, else the file is one document. `--val-fraction F` holds out F of the
documents, chosen by the seed. Windows are cut inside runs of training documents and inside runs
of held-out ones, so no window straddles the two:

    documents   | d0 ......... | d1 .... | d2 ....... | d3 ...... |        (d1 held out)
    windows     [ w0 ][ w1 ][  ][ v0 ][  ][ w2 ][ w3 ][ w4 ][    ]         (s + 1 tokens each)

A window of seq_len + 1 tokens gives the input (its first seq_len tokens) and the target (the
same, shifted by one); it shares its last token with the next window's first. The training
windows are shuffled by a permutation drawn from the seed, one per epoch. A run is a walk through
that fixed order: optimizer step t uses the next `global_batch` windows, and data-parallel rank
r takes rows [r*G/dp, (r+1)*G/dp) of them. The only state is how many windows were consumed,
which the checkpoint stores, so a resumed run reads exactly what the uninterrupted one would have.
The held-out windows are shuffled once; every evaluation reads the same first batches of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minipar.run.data import BLOCK, EOT, DataError


def documents(parts: list[np.ndarray], eot: int | None) -> np.ndarray:
    """[n, 3] (part, start, end) of every document: each span that ends with <|endoftext|>, and a
    part's tail without one. Token files are scanned a block at a time."""
    rows = []
    for p, tokens in enumerate(parts):
        found = [np.flatnonzero(tokens[a:a + BLOCK] == eot) + a + 1 for a in range(0, len(tokens), BLOCK)
                 if eot is not None]
        ends = np.unique(np.concatenate(found + [np.array([len(tokens)])]))
        rows.append(np.stack([np.full(len(ends), p), np.concatenate([[0], ends[:-1]]), ends], axis=1))
    return np.concatenate(rows).astype(np.int64)


def held_out(n_docs: int, fraction: float, seed: int) -> np.ndarray:
    """[n_docs] bool: the documents kept for validation, round(fraction * n_docs) of them (at
    least one, and never all), drawn by the seed."""
    k = 0 if fraction == 0 else min(n_docs - 1, max(1, round(fraction * n_docs)))
    if fraction and k < 1:
        raise DataError(f"--val-fraction {fraction}: the data is one document, with nothing to hold out; give several "
                        f"files, or separate documents with {EOT}")
    chosen = np.zeros(n_docs, dtype=bool)
    chosen[np.random.default_rng([seed, 1]).permutation(n_docs)[:k]] = True
    return chosen


def windows_in(docs: np.ndarray, keep: np.ndarray, seq_len: int) -> np.ndarray:
    """[n, 2] (part, first token) of the windows of seq_len + 1 tokens cut in each run of
    consecutive kept documents of one part, one after the other (each shares its last token
    with the next window's first)."""
    index = np.flatnonzero(keep)
    kept = docs[index]
    if not len(kept):
        return np.zeros((0, 2), dtype=np.int64)
    new_run = np.ones(len(kept), dtype=bool)
    new_run[1:] = (np.diff(index) != 1) | (kept[1:, 0] != kept[:-1, 0])
    first = np.flatnonzero(new_run)
    last = np.append(first[1:], len(kept)) - 1
    part, start, end = kept[first, 0], kept[first, 1], kept[last, 2]
    counts = np.maximum((end - start - 1) // seq_len, 0)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([np.repeat(part, counts), np.repeat(start, counts) + seq_len * within], axis=1)


@dataclass
class TokenData:
    """Windows of the token files in a seeded order, and the held-out windows (module docstring)."""

    folder: Path
    seq_len: int
    seed: int
    val_fraction: float = 0.0

    def __post_init__(self):
        meta = json.loads((self.folder / "meta.json").read_text())
        self.vocab_size, self.fingerprint = meta["vocab_size"], meta.get("fingerprint", self.folder.name)
        self.tokenizer_file = self.folder / "tokenizer.json" if (self.folder / "tokenizer.json").exists() else None
        self.parts = [np.memmap(self.folder / p, dtype=meta["dtype"], mode="r")
                      for p in meta.get("parts", ["tokens.bin"])]  # a cache from before token files: one
        self.tokens = self.parts[0]  # the first (text: the only) token file
        eot = meta.get("eot", 0)  # a cache from before token files: a trained BPE, whose <|endoftext|> is id 0
        docs = documents(self.parts, eot if self.val_fraction else None)
        val = held_out(len(docs), self.val_fraction, self.seed)
        self.windows, self.val_windows = windows_in(docs, ~val, self.seq_len), windows_in(docs, val, self.seq_len)
        self.num_windows, self.val_docs = len(self.windows), int(val.sum())
        if self.num_windows < 1:
            tokens = int(docs[~val, 2].sum() - docs[~val, 1].sum())
            raise DataError(f"the corpus has {tokens} tokens for training, fewer than one window of --seq-len "
                            f"{self.seq_len} + 1: use more text or a shorter sequence")
        self.val_order = np.random.default_rng([self.seed, 2]).permutation(len(self.val_windows))
        self._perms: dict[int, torch.Tensor] = {}

    def window_ids(self, start: int, count: int) -> list[int]:
        """Indices of windows start, start+1, ... of the run's order (epochs wrap around)."""
        ids = []
        for k in range(start, start + count):
            epoch, i = divmod(k, self.num_windows)
            if epoch not in self._perms:
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._perms = {epoch: torch.randperm(self.num_windows, generator=g)}
            ids.append(int(self._perms[epoch][i]))
        return ids

    def fetch(self, window_ids, table: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [len(window_ids), seq_len] int64, of rows of `table` (default:
        the training windows)."""
        table, s = self.windows if table is None else table, self.seq_len
        rows = np.stack([self.parts[p][o : o + s + 1] for p, o in table[list(window_ids)]]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    def rank_batch(self, consumed: int, global_batch: int, dp_rank: int, dp: int):
        """This data-parallel rank's rows of the global batch that starts after `consumed` windows."""
        per_rank = global_batch // dp
        ids = self.window_ids(consumed, global_batch)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        return self.fetch(ids)

    def rank_val_batch(self, k: int, global_batch: int, dp_rank: int, dp: int):
        """This rank's rows of held-out batch k: the same windows at every evaluation."""
        per_rank = global_batch // dp
        ids = self.val_order[k * global_batch + dp_rank * per_rank : k * global_batch + (dp_rank + 1) * per_rank]
        return self.fetch(ids, self.val_windows)
