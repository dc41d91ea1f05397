"""Exercise 7.3 (chapter 7, "Bytes"), explore: ep vs all-to-all bytes per rank.

Run this file: for the small-moe model (float32, one sequence of 256 tokens per rank) it prints,
at ep 2, 4 and 8, what a rank sends on ep per step and the expert weights it holds, by chapter 7's
formulas (per MoE block and micro-batch: the counts, (ep - 1) E/ep int64s, and the rows, out and
back, forward and backward: 4 T k (ep - 1)/ep rows of d numbers under uniform routing). By how much
does the all-to-all traffic of a rank grow from ep 2 to ep 8 (write the ratio)? What fraction of
a rank's assignments leaves it at each ep, and what is the limit?

    python docs/exercises/ex7_3_explore_ep_bytes.py

Check: make exercise N=7.3
"""

ANSWER = None  # bytes a rank sends on ep at ep 8 / at ep 2

if __name__ == "__main__":
    import minipar.moe  # noqa: F401 - adds the MoE block to the model
    from minipar.collectives import ring_bytes_sent
    from minipar.model import Llama, get_config

    c, tokens, width = get_config("small-moe"), 256, 4  # float32
    model = Llama(c)
    blocks = sum(c.feed_forward(i) == "moe" for i in range(c.n_layers))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)  # E/ep of them on a rank
    rest = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)  # the rest whole
    for ep in (2, 4, 8):
        counts = (ep - 1) * (c.n_experts // ep) * 8  # each other rank's count of each of its experts
        rows = 4 * tokens * c.top_k * (ep - 1) // ep * c.dim * width  # out and back, forward and backward
        sent = blocks * (counts + rows) + ring_bytes_sent("all_reduce", 4, ep)  # + the gradient norm's one number
        weights = (rest + experts // ep) * width / 2**20
        print(f"ep {ep}: sends {sent:>10,} bytes on ep per step; weights {weights:.2f} MiB")
