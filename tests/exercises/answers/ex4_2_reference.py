"""Exercise 4.2, the file's bytes, tp 4 over tp 2: chapter 4's message lists (a region's f and g, the
embedding's and head's all-reduce, the vocabulary-parallel loss, the replicated kv heads' gradients at
tp 4, the gradient norm), each by chapter 1's ring_bytes_sent."""

from minipar.collectives import ring_bytes_sent
from minipar.model import get_config
from minipar.tensor_parallel import loss_messages, region_messages


def _tp_sent(tp, tokens=256, width=4):
    c = get_config("small")
    stream = tokens * c.dim * width
    messages = region_messages(stream, stream, tp, False) * (2 * c.n_layers)
    messages += [("tp/all_reduce", ring_bytes_sent("all_reduce", stream, tp))] * 2 + loss_messages(tokens, width, tp)
    if tp > c.n_kv_heads:
        kv = 2 * c.n_layers * c.n_kv_heads * c.head_dim * c.dim * width
        messages += [("tp/all_reduce", ring_bytes_sent("all_reduce", kv, tp))]
    return sum(n for _, n in messages) + ring_bytes_sent("all_reduce", 4, tp)


ANSWER = _tp_sent(4) / _tp_sent(2)
