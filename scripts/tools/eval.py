"""Validation loss and perplexity of a checkpoint on held-out text, on one process.

    .venv/bin/python scripts/tools/eval.py runs/run_001 --data held_out/        # a text file or a folder

The text is tokenised with the run's own tokenizer, joined with <|endoftext|> between files as in
training, and cut into consecutive windows of --seq-len + 1 tokens (no shuffling, no overlap). The
loss is the mean next-token cross-entropy over every target of every window; the perplexity is
its exponential. Use text the run did not train on: train.py's --data is read whole. A bad flag
or file is one line and exit code 2 (minipar/ops/args.py).
"""

import math

import numpy as np
import torch
from tokenizers import Tokenizer

from minipar.extras.generate import checkpoint_tokenizer, plain_model_from, run_config
from minipar.layout import MAX_BATCH  # windows per forward, as train.py's --global-batch
from minipar.ops import run_folder
from minipar.ops.args import HelpFormatter, Parser, existing_file, non_negative_int, positive_int, refusals
from minipar.run import checkpoint
from minipar.run.data import EOT, DataError, encode_files, find_files  # names a file that is not text
from minipar.run.paths import InputError


def parse_args(argv=None):
    p = Parser(prog="eval.py", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, or an --out folder (its newest that verifies)")
    p.add_argument("--data", required=True, help="held-out text: a file or a folder of them")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per window (default: the run's)")
    p.add_argument("--batch-size", type=positive_int, default=8, help=f"windows per forward (at most {MAX_BATCH})")
    p.add_argument("--max-windows", type=non_negative_int, default=0, help="stop after this many windows (0: all)")
    p.add_argument("--tokenizer", type=existing_file, default=None,
                   help="tokenizer.json (default: the checkpoint's, or the run's data cache's)")
    return p.parse_args(argv)


def window_length(seq_len: int | None, state: dict, path, max_seq_len: int) -> int:
    """--seq-len, else the run's; at most the model's max_seq_len, as train.py demands."""
    if seq_len is None:
        seq_len = run_config(state, path).get("seq_len")
        if type(seq_len) is not int or seq_len < 1:
            raise checkpoint.CheckpointError(f"checkpoint {path}: its train_state.json holds no --seq-len "
                                             f"({seq_len!r}); give --seq-len")
    if seq_len > max_seq_len:
        raise InputError(f"--seq-len {seq_len} is above the model's max_seq_len {max_seq_len}: give "
                         f"{max_seq_len} or less")
    return seq_len


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
    with refusals():  # CheckpointError, DataError, InputError: one line
        args = parse_args(argv)
        if args.batch_size > MAX_BATCH:
            raise InputError(f"--batch-size {args.batch_size}: give 1 to {MAX_BATCH} windows")
        path = run_folder.resolve(args.checkpoint, flag="checkpoint")
        model, state = plain_model_from(path)
        seq_len = window_length(args.seq_len, state, path, model.config.max_seq_len)
        tok = checkpoint_tokenizer(state, path, model.config.vocab_size, args.tokenizer, separator=True)  # joins files
        rows = windows(tok, args.data, seq_len, args.max_windows)
    loss, count = evaluate(model, rows, args.batch_size)
    print(f"{path}: {count:,} targets in {len(rows)} windows of {seq_len} tokens | loss {loss:.4f} | "
          f"perplexity {math.exp(loss):.2f}")
    return loss, math.exp(loss)


if __name__ == "__main__":
    main()
