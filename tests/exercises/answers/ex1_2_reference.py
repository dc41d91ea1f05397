"""Exercise 1.2, the ledger's formula."""

from minipar.collectives import ring_bytes_sent

ANSWER = tuple(ring_bytes_sent(op, 4 * 2**20, 4) for op in ("all_reduce", "reduce_scatter", "all_gather"))
