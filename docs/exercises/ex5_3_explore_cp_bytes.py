"""Exercise 5.3 (chapter 5, "Ring attention"), explore: cp vs bytes per rank.

Ring attention passes each rank's K and V blocks around the ring: cp - 1 hops of a block of
s/cp tokens. Run this file: for the small model (float32, one sequence of 256 tokens) it prints
what a rank sends on cp per step at cp 2, 4 and 8, from chapter 5's own message list
(`context_parallel.attention_messages`: forward and backward of one layer's attention). By how
much does it grow from cp 2 to cp 8 (write the ratio)? What does it tend to as cp grows, and how
does that compare with what each rank's attention computes?

    python docs/exercises/ex5_3_explore_cp_bytes.py

Check: make exercise N=5.3
"""

ANSWER = None  # bytes a rank sends on cp at cp 8 / at cp 2

if __name__ == "__main__":
    from minipar.context_parallel import attention_messages
    from minipar.model import get_config

    c, seq_len, width = get_config("small"), 256, 4  # float32: q and k after RoPE, v and the output alike
    for cp in (2, 4, 8):
        per_layer = attention_messages("ring", seq_len // cp, c.n_heads, c.n_kv_heads, c.head_dim, cp, width, width)
        sent = c.n_layers * sum(n for _, n in per_layer)
        print(f"cp {cp}: {seq_len // cp:>3} tokens per rank, sends {sent:>10,} bytes on cp per step "
              f"({len(per_layer)} messages a layer)")
