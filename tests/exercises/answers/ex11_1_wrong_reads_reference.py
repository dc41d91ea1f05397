"""Exercise 11.1, wrong: reads the checker's reference answer through linecache (the module
tracebacks read source lines with) and executes its text."""

import linecache
from pathlib import Path

_reference = str(Path(__file__).with_name("ex11_1_reference.py"))


def recompute_selectively(model):
    namespace: dict = {}
    exec("".join(linecache.getlines(_reference)), namespace)  # noqa: S102
    namespace["recompute_selectively"](model)
