"""Exercise 3.3 (chapter 3, "The memory problem"), explore: how many ranks ZeRO-3 needs.

Llama-3.1-8B in bf16 mixed precision (16 bytes per parameter of model states), one 4,096-token
sequence per rank, ZeRO-3 over dp ranks: at which dp does the fullest rank first fit in an 80 GB
H100? Run this file (the estimator's peak per rank: states, activations and ZeRO's buffers) and
write the smallest dp that fits. Which part stops shrinking as dp grows, and why?

    python docs/exercises/ex3_3_explore_zero3_dp.py

Check: make exercise N=3.3
"""

ANSWER = None  # the smallest dp of the table that fits in 80 GB

if __name__ == "__main__":
    from minipar.model import get_config
    from minipar.planning.estimate import activation_bytes, held_bytes, peak_bytes
    from minipar.run.config import TrainConfig

    c = get_config("8b")
    for dp in (1, 2, 4, 8, 16, 32):
        cfg = TrainConfig(model="8b", dp=dp, zero=3, seq_len=4096, micro_batch=1, global_batch=dp,
                          precision="bf16-mixed", vocab_size=c.vocab_size)
        states = sum(held_bytes(c, cfg).values())
        print(f"dp {dp:>2}: peak {peak_bytes(c, cfg) / 1e9:6.1f} GB (model states {states / 1e9:6.1f} GB, "
              f"activations {activation_bytes(c, cfg) / 1e9:5.1f} GB)")
