"""Exercise 5.3, the file's bytes, cp 8 over cp 2: chapter 5's attention_messages for ring attention
(K and V round the ring: cp - 1 hops forward, cp backward), once per layer."""

from minipar.context_parallel import attention_messages
from minipar.model import get_config


def _cp_sent(cp, seq_len=256, width=4):
    c = get_config("small")
    per_layer = attention_messages("ring", seq_len // cp, c.n_heads, c.n_kv_heads, c.head_dim, cp, width, width)
    return c.n_layers * sum(n for _, n in per_layer)


ANSWER = _cp_sent(8) / _cp_sent(2)
