"""Exercise 6.1, wrong: runs the checker's reference answer (tests/exercises/answers/)."""

import runpy
from pathlib import Path

_reference = Path(__file__).with_name("ex6_1_reference.py")


def gpipe(p, m):
    return runpy.run_path(str(_reference))["gpipe"](p, m)
