"""Sample text from a checkpoint, on one process, whatever layout trained it.

    .venv/bin/python scripts/sample.py runs/run_001 --prompt "def main(" --tokens 60
    .venv/bin/python scripts/sample.py runs/run_001/step_000300 --temperature 0.8 --top-k 40 --seed 1

A checkpoint holds every tensor at its single-device shape (checkpoint.py), so the plain model
loads it directly. The tokenizer is the run's own, which the checkpoint keeps (older checkpoints:
found in the data cache under the key the checkpoint keeps; or give --tokenizer). Generation keeps a KV
cache (minipar/run/generate.py).
"""

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from minipar.run import checkpoint
from minipar.run.generate import generate, plain_model_from, tokenizer_path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, or an --out folder (its newest that verifies)")
    p.add_argument("--prompt", default="\n", help="the text to continue")
    p.add_argument("--tokens", type=int, default=100, help="how many tokens to add")
    p.add_argument("--temperature", type=float, default=0.0, help="0: always the most likely token")
    p.add_argument("--top-k", type=int, default=0, help="draw among the k most likely only (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's, from the data cache)")
    return p.parse_args(argv)


def tokenizer_of(state: dict, given: str | None, folder: Path) -> Tokenizer:
    path = Path(given) if given else tokenizer_path(state, folder)
    if not path.exists():
        data = state["config"]["data"] or "the standard library"
        raise SystemExit(f"sample.py: error: no tokenizer at {path}: train.py builds it from the run's --data "
                         f"({data}); give --tokenizer PATH")
    return Tokenizer.from_file(str(path))


def main(argv=None) -> str:
    args = parse_args(argv)
    try:
        path = checkpoint.resolve(args.checkpoint)
        model, state = plain_model_from(path)
    except ValueError as e:  # CheckpointError: missing, corrupt
        sys.exit(f"sample.py: error: {e}")
    tok = tokenizer_of(state, args.tokenizer, path)
    prompt = torch.tensor([tok.encode(args.prompt).ids or [0]])
    out = generate(model, prompt, args.tokens, args.temperature, args.top_k,
                   torch.Generator().manual_seed(args.seed))
    text = tok.decode(out[0].tolist())
    print(text)
    return text


if __name__ == "__main__":
    main()
