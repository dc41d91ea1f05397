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

if __name__ == "__main__":
    from minipar.model import get_config
    from minipar.planning.estimate import activation_bytes, held_bytes
    from minipar.run.config import TrainConfig

    c = get_config("small")
    print(f"{'seq_len':>8}{'activations':>16}{'model states':>16}")
    for seq_len in (64, 128, 256, 512, 1024, 2048):
        cfg = TrainConfig(model="small", seq_len=seq_len, micro_batch=1, global_batch=1, dtype="float32")
        print(f"{seq_len:>8}{activation_bytes(c, cfg) / 2**20:>12.2f} MiB"
              f"{sum(held_bytes(c, cfg).values()) / 2**20:>12.2f} MiB")
