"""Exercise 8.3, wrong (issue 40's walk-around): the checker's own key, imported from tests/exercises and called
on the variant, not a prediction. A prediction is a value written out; code that computes it is refused."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ANSWER(v):  # noqa: N802
    from checks_answers_4_9 import truth_compute_seconds
    return truth_compute_seconds(v.gpus, v.seq_len, v.global_batch)
