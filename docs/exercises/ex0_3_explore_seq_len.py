"""Exercise 0.3 (chapter 0, "Why one device is not enough"), explore: when activations win.

Model states (weights, gradients, AdamW's moments: 16 bytes per parameter) do not depend on the
tokens; activations grow with them. For the small model in float32 with one sequence per step,
at which sequence length do the activations first outgrow the model states? Run this file, read
the table, and write the first length (one of the lengths in the table) below:

    python docs/exercises/ex0_3_explore_seq_len.py

Then ask: at what length would the same happen for 8b (chapter 0's table: 120 GiB of states,
26 GiB of activations at 4,096 tokens)?

Check: make exercise N=0.3
"""

ANSWER = None  # a sequence length from the table

if __name__ == "__main__":  # chapter 0's own tools: the plain model, and its script's count of what autograd saves
    import sys
    from pathlib import Path

    import torch

    from minipar.model import Llama, get_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "course"))
    from step_00_one_device import kept_for_backward  # (exercise 0.1 has you write it)

    c = get_config("small")
    model = Llama(c, seed=0)  # float32
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # kept anyway: not activations
    states = 16 * sum(p.numel() for p in model.parameters())  # weights, gradients, AdamW's 2 moments: 4 x 4 bytes
    print(f"{'seq_len':>8}{'activations':>16}{'model states':>16}")
    for seq_len in (64, 128, 256, 512, 1024):
        tokens = torch.randint(0, c.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
        activations = kept_for_backward(lambda t=tokens: model(t[:, :-1], t[:, 1:]), weights)
        print(f"{seq_len:>8}{activations / 2**20:>12.2f} MiB{states / 2**20:>12.2f} MiB")
