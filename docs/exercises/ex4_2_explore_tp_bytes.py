"""Exercise 4.2 (chapter 4, "What it costs"), explore: tp vs bytes per rank.

Tensor parallelism cuts every weight by tp but sends activations: an all-reduce per f and g. Run
this file: for the small model (float32, one sequence of 256 tokens per step) it prints what a
rank holds in weights and sends on the tp group at tp 1, 2 and 4, worked out with chapter 4's own
message lists (`tensor_parallel.region_messages` for a region, `loss_messages` for the loss) and
chapter 1's `ring_bytes_sent`. By how much does a rank's tp traffic grow from tp 2 to tp 4 (write
the ratio)? Compare with 2(N-1)/N of chapter 1: what does it say about adding more tp ranks, and
why must tp stay inside a node? (At tp 4 the small model's 2 kv heads are replicated: what does
that add?)

    python docs/exercises/ex4_2_explore_tp_bytes.py

Check: make exercise N=4.2
"""

ANSWER = None  # bytes a rank sends on tp at tp 4 / at tp 2

if __name__ == "__main__":
    from minipar.collectives import ring_bytes_sent
    from minipar.model import Llama, get_config
    from minipar.tensor_parallel import loss_messages, region_messages

    c, tokens, width = get_config("small"), 256, 4  # float32
    model = Llama(c)
    split = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "tok_emb", "lm_head")  # cut by tp (vocab: the ends)

    def held_numel(name: str, numel: int, tp: int) -> int:
        """A rank's share of a weight: the norms whole; wk, wv whole too where there are fewer kv heads than ranks."""
        kind = name.split(".")[-2]
        whole = kind not in split or kind in ("wk", "wv") and tp > c.n_kv_heads
        return numel if whole else numel // tp

    for tp in (1, 2, 4):
        replicated_kv = tp > c.n_kv_heads
        held = sum(held_numel(n, p.numel(), tp) for n, p in model.named_parameters()) * width
        stream = tokens * c.dim * width  # a region's input (f) and output (g): [b s, d]
        messages = region_messages(stream, stream, tp, False) * (2 * c.n_layers)  # attention and MLP of each layer
        messages += [("tp/all_reduce", ring_bytes_sent("all_reduce", stream, tp))] * 2  # the embedding's, the head's
        messages += loss_messages(tokens, width, tp)  # the vocabulary-parallel loss
        if replicated_kv:  # their gradients, partial on each rank, summed over tp once per step
            kv = 2 * c.n_layers * c.n_kv_heads * c.head_dim * c.dim * width
            messages += [("tp/all_reduce", ring_bytes_sent("all_reduce", kv, tp))]
        messages += [("tp/all_reduce", ring_bytes_sent("all_reduce", 4, tp))]  # the gradient norm's square, summed
        sent = sum(n for _, n in messages) if tp > 1 else 0
        print(f"tp {tp}: weights {held / 2**20:6.2f} MiB per rank, sends {sent:>10,} bytes on tp per step")
