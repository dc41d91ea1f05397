"""Exercise 4.2 (chapter 4, "What it costs"), explore: tp vs bytes per rank.

Tensor parallelism cuts every weight by tp but sends activations: an all-reduce per f and g. Run
this file: for the small model (float32, one sequence of 256 tokens per step) it prints what a
rank holds in weights and sends on the tp group at tp 1, 2 and 4. By how much does a rank's tp
traffic grow from tp 2 to tp 4 (write the ratio)? Compare with 2(N-1)/N of chapter 1: what does
it say about adding more tp ranks, and why must tp stay inside a node?

    python docs/exercises/ex4_2_explore_tp_bytes.py

Check: make exercise N=4.2
"""

ANSWER = None  # bytes a rank sends on tp at tp 4 / at tp 2

if __name__ == "__main__":
    from minipar.model import get_config
    from minipar.planning.estimate import held_bytes
    from minipar.planning.traffic import bytes_sent
    from minipar.run.config import TrainConfig

    c = get_config("small")
    for tp in (1, 2, 4):
        cfg = TrainConfig(model="small", tp=tp, seq_len=256, micro_batch=1, global_batch=1, dtype="float32")
        sent = sum(v for k, v in bytes_sent(c, cfg).items() if k.startswith("tp/"))
        print(f"tp {tp}: weights {held_bytes(c, cfg)['params'] / 2**20:6.2f} MiB per rank, "
              f"sends {sent:>10,} bytes on tp per step")
