"""Exercise 5.3 (chapter 5, "Ring attention"), explore: cp vs bytes per rank.

Ring attention passes each rank's K and V blocks around the ring: cp - 1 hops of a block of
s/cp tokens. Run this file: for the small model (float32, one sequence of 256 tokens) it prints
what a rank sends on cp per step at cp 2, 4 and 8. By how much does it grow from cp 2 to cp 8
(write the ratio)? What does it tend to as cp grows, and how does that compare with what each
rank's attention computes?

    python docs/exercises/ex5_3_explore_cp_bytes.py

Check: make exercise N=5.3
"""

ANSWER = None  # bytes a rank sends on cp at cp 8 / at cp 2

if __name__ == "__main__":
    from minipar.model import get_config
    from minipar.planning.traffic import bytes_sent
    from minipar.run.config import TrainConfig

    c = get_config("small")
    for cp in (2, 4, 8):
        cfg = TrainConfig(model="small", cp=cp, seq_len=256, micro_batch=1, global_batch=1, dtype="float32")
        sent = sum(v for k, v in bytes_sent(c, cfg).items() if k.startswith("cp/"))
        print(f"cp {cp}: {256 // cp:>3} tokens per rank, sends {sent:>10,} bytes on cp per step")
