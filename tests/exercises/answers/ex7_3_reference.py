"""Exercise 7.3, the file's bytes, ep 8 over ep 2: chapter 7's formula per MoE block and micro-batch,
the counts ((ep - 1) E/ep int64s) and the rows out and back, forward and backward (4 T k (ep - 1)/ep
rows of d numbers), and the gradient norm's one number summed over ep."""

from minipar.collectives import ring_bytes_sent
from minipar.model import get_config


def _ep_sent(ep, tokens=256, width=4):
    c = get_config("small-moe")
    blocks = sum(c.feed_forward(i) == "moe" for i in range(c.n_layers))
    per_block = (ep - 1) * (c.n_experts // ep) * 8 + 4 * tokens * c.top_k * (ep - 1) // ep * c.dim * width
    return blocks * per_block + ring_bytes_sent("all_reduce", 4, ep)


ANSWER = _ep_sent(8) / _ep_sent(2)
