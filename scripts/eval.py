"""Validation loss and perplexity of a checkpoint on held-out text, on one process.

    .venv/bin/python scripts/eval.py runs/run_001 --data held_out/        # a text file or a folder

The text is tokenised with the run's own tokenizer, joined with <|endoftext|> between files as in
training, and cut into consecutive windows of --seq-len + 1 tokens (no shuffling, no overlap). The
loss is the mean next-token cross-entropy over every target of every window; the perplexity is
its exponential. Use text the run did not train on: train.py's --data is read whole.
"""

import argparse
import math
import sys

import numpy as np
import torch
from tokenizers import Tokenizer

from minipar.run import checkpoint
from minipar.run.data import EOT, DataError, encode_files, find_files  # names a file that is not text
from minipar.run.generate import plain_model_from, tokenizer_path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, or an --out folder (its newest that verifies)")
    p.add_argument("--data", required=True, help="held-out text: a file or a folder of them")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the run's)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    p.add_argument("--max-windows", type=int, default=0, help="stop after this many windows (0: all)")
    return p.parse_args(argv)


def windows(tokenizer: Tokenizer, data: str, seq_len: int, limit: int) -> torch.Tensor:
    """[n, seq_len + 1] consecutive windows of the tokenised text."""
    eot = tokenizer.token_to_id(EOT)
    ids = np.concatenate(list(encode_files(tokenizer, find_files(data), eot)))
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise DataError(f"--data {data}: {len(ids)} tokens, fewer than one window of --seq-len {seq_len} + 1")
    n = min(n, limit) if limit else n
    return torch.from_numpy(ids[: n * seq_len + 1]).unfold(0, seq_len + 1, seq_len)


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, batch_size: int) -> tuple[float, int]:
    """(mean loss over every target, number of targets)."""
    total, count = 0.0, 0
    for batch in rows.split(batch_size):
        x, y = batch[:, :-1], batch[:, 1:]
        total += float(model(x, y, 1.0))  # with a divisor of 1: the sum of the token losses
        count += y.numel()
    return total / count, count


def main(argv=None) -> tuple[float, float]:
    args = parse_args(argv)
    try:
        path = checkpoint.resolve(args.checkpoint)
        model, state = plain_model_from(path)
        seq_len = args.seq_len or state["config"]["seq_len"]
        tok = Tokenizer.from_file(str(tokenizer_path(state, path)))
        rows = windows(tok, args.data, seq_len, args.max_windows)
    except (ValueError, OSError) as e:  # CheckpointError, DataError, a missing tokenizer
        sys.exit(f"eval.py: error: {e}")
    loss, count = evaluate(model, rows, args.batch_size)
    print(f"{path}: {count:,} targets in {len(rows)} windows of {seq_len} tokens | loss {loss:.4f} | "
          f"perplexity {math.exp(loss):.2f}")
    return loss, math.exp(loss)


if __name__ == "__main__":
    main()
