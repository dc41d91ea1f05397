"""Exercise 5.1, wrong: the library's zigzag_positions from a fresh import of its module (taken out of
sys.modules first, so that `import` executes it again)."""

import importlib
import sys


def zigzag_positions(rank, cp, seq_len):
    saved = sys.modules.pop("minipar.context_parallel")
    try:
        return importlib.import_module("minipar.context_parallel").zigzag_positions(rank, cp, seq_len)
    finally:
        sys.modules["minipar.context_parallel"] = saved
