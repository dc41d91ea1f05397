"""Check one exercise of docs/exercises/: `make exercise N=3.1` (chapter 3, exercise 1), or
`python tests/exercises/run.py 3.1 [path/to/your_file.py]`; `make exercise` lists them.

Prints PASS, or each problem (which rank, which tensor, the largest difference), and exits 1.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]  # minipar, harness, checks

import checks  # noqa: E402
import harness  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in checks.EXERCISES:
        print("usage: make exercise N=<chapter.exercise>, e.g. N=3.1   (or: python tests/exercises/run.py 3.1 "
              "[your_file.py])")
        for n, (name, kind, title, _, minutes) in checks.EXERCISES.items():
            print(f"  {n:<4} {kind:<9} {title:<66} docs/exercises/{name}  (~{minutes})")
        return 0 if not argv else 2
    number = argv[0]
    path = Path(argv[1]) if len(argv) > 1 else checks.EXERCISES_DIR / checks.EXERCISES[number][0]
    question = checks.asked(number, path)
    if question:  # a predict exercise: the numbers of the student's variant
        print(f"exercise {number}, {question}")
    start = time.monotonic()
    try:
        problems = checks.check(number, path, harness.run_ranks)
    finally:
        harness.shutdown()
    took = f"({time.monotonic() - start:.1f}s)"
    if problems:
        print(f"exercise {number}, {path}: FAIL {took}")
        for p in problems:
            print("  " + p)
        return 1
    print(f"exercise {number}, {path}: PASS {took}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
