"""Exercise 7.3 (chapter 7, "Bytes"), explore: ep vs all-to-all bytes per rank.

Run this file: for the small-moe model (float32, one sequence of 256 tokens per rank) it prints,
at ep 2, 4 and 8, what a rank sends on ep per step and the expert weights it holds. By how much
does the all-to-all traffic of a rank grow from ep 2 to ep 8 (write the ratio)? What fraction of
a rank's assignments leaves it at each ep, and what is the limit?

    python docs/exercises/ex7_3_explore_ep_bytes.py

Check: make exercise N=7.3
"""

ANSWER = None  # bytes a rank sends on ep at ep 8 / at ep 2

if __name__ == "__main__":
    from minipar.model import get_config
    from minipar.planning.estimate import held_bytes
    from minipar.planning.traffic import bytes_sent
    from minipar.run.config import TrainConfig

    c = get_config("small-moe")
    for ep in (2, 4, 8):
        cfg = TrainConfig(model="small-moe", dp=ep, ep=ep, seq_len=256, micro_batch=1, global_batch=ep,
                          dtype="float32")
        sent = sum(v for k, v in bytes_sent(c, cfg).items() if k.startswith("ep/"))
        weights = held_bytes(c, cfg)["params"] / 2**20
        print(f"ep {ep}: sends {sent:>10,} bytes on ep per step; weights {weights:.2f} MiB")
