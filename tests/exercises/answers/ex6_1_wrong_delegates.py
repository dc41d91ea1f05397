"""Exercise 6.1, wrong: the library's own gpipe, imported: the checker switches it off."""


from minipar.pipeline.schedules import gpipe  # noqa: F401 - the checker calls it
