"""Sample text from a checkpoint, on one process, whatever layout trained it.

    .venv/bin/python scripts/tools/sample.py runs/run_001 --prompt "def main(" --tokens 60
    .venv/bin/python scripts/tools/sample.py runs/run_001/step_000300 --temperature 0.8 --top-k 40 --seed 1

A checkpoint holds every tensor at its single-device shape (checkpoint.py), so the plain model
loads it directly. The tokenizer is the run's own, which the checkpoint keeps (older checkpoints:
found in the data cache under the key the checkpoint keeps; or give --tokenizer). Generation keeps a KV
cache (minipar/extras/generate.py). A bad flag or file is one line and exit code 2 (minipar/ops/args.py).
"""

import torch

from minipar.extras.generate import checkpoint_tokenizer, generate, plain_model_from
from minipar.ops import run_folder
from minipar.ops.args import HelpFormatter, Parser, existing_file, non_negative_float, non_negative_int, refusals
from minipar.run.paths import InputError

# Below MIN_TEMPERATURE the draw is all but greedy, and soon the logits divided by it overflow float32
# (1e-40: a NaN draw); above MAX_TEMPERATURE every token is about as likely as any other.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3


def parse_args(argv=None):
    p = Parser(prog="sample.py", description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint folder, or an --out folder (its newest that verifies)")
    p.add_argument("--prompt", default="\n", help="the text to continue")
    p.add_argument("--tokens", type=non_negative_int, default=100, help="how many tokens to add")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: always the most likely token; "
                   f"else {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="draw among the k most likely only (0: all)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="the draws' seed, 0 to 2**64 - 1")
    p.add_argument("--tokenizer", type=existing_file, default=None,
                   help="tokenizer.json (default: the checkpoint's, or the run's data cache's)")
    return p.parse_args(argv)


def main(argv=None) -> str:
    with refusals():  # CheckpointError, DataError, InputError: one line
        args = parse_args(argv)
        if args.temperature and not MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE:
            raise InputError(f"--temperature {args.temperature:g}: give 0 (the most likely token) or "
                             f"{MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}")
        if args.seed >= 2**64:  # a torch.Generator's seed is 64 bits
            raise InputError(f"--seed {args.seed}: give 0 to 2**64 - 1")
        path = run_folder.resolve(args.checkpoint, flag="checkpoint")
        model, state = plain_model_from(path)
        tok = checkpoint_tokenizer(state, path, model.config.vocab_size, args.tokenizer)
        prompt = torch.tensor([tok.encode(args.prompt).ids or [0]])
        if prompt.shape[1] + args.tokens > model.config.max_seq_len:
            raise InputError(f"--tokens {args.tokens} after the prompt's {prompt.shape[1]} tokens pass the model's "
                             f"max_seq_len {model.config.max_seq_len}: give --tokens "
                             f"{max(model.config.max_seq_len - prompt.shape[1], 0)} or fewer, or a shorter prompt")
    out = generate(model, prompt, args.tokens, args.temperature, args.top_k, torch.Generator().manual_seed(args.seed))
    text = tok.decode(out[0].tolist())
    print(text)
    return text


if __name__ == "__main__":
    main()
