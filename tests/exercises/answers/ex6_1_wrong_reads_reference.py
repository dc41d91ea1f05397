"""Exercise 6.1, wrong: reads the checker's reference answer through linecache (the module tracebacks
read source lines with) and executes its text."""

import linecache
from pathlib import Path

_reference = str(Path(__file__).with_name("ex6_1_reference.py"))


def gpipe(p, m):
    namespace: dict = {}
    exec("".join(linecache.getlines(_reference)), namespace)  # noqa: S102
    return namespace["gpipe"](p, m)
