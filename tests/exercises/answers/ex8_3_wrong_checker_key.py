"""Exercise 8.3, wrong (issue 40's walk-around): the checker's own key, imported from tests/exercises
and called when the file is loaded, for the variant's numbers (which `make exercise` prints)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checks_answers_4_9 import truth_compute_seconds  # noqa: E402

SEED = 0
ANSWER = truth_compute_seconds(64, 8192, 256)  # the numbers of some variant
