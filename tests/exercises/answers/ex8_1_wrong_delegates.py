"""Exercise 8.1, wrong: the library's own model_state_bytes, imported: the checker switches it off."""


from minipar.zero import model_state_bytes  # noqa: F401 - the checker calls it
