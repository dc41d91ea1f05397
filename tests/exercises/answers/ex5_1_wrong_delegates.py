"""Exercise 5.1, wrong: the library's own zigzag_positions, imported: the checker switches it off."""


from minipar.context_parallel import zigzag_positions  # noqa: F401 - the checker calls it
