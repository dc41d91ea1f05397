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
    argv = [word for arg in argv for word in arg.split()]  # make exercise N='1.1 2.1': several, in turn
    if len(argv) > 1 and all(a in checks.EXERCISES for a in argv):
        return max(main([number]) for number in argv)
    if not argv or argv[0] not in checks.EXERCISES:
        if argv:
            print(f"run.py: no exercise {argv[0]!r}: give one of those below", file=sys.stderr)
        print("usage: make exercise N=<chapter.exercise>, e.g. N=3.1   (or: python tests/exercises/run.py 3.1 "
              "[your_file.py])")
        for n, (name, kind, title, _, minutes) in checks.EXERCISES.items():
            print(f"  {n:<5} {kind:<9} {title:<66} docs/exercises/{name}  (~{minutes})")
        return 0 if not argv else 2
    number = argv[0]
    path = Path(argv[1]) if len(argv) > 1 else checks.EXERCISES_DIR / checks.EXERCISES[number][0]
    if len(argv) > 2 or not path.is_file():
        print(f"run.py: {'give one file after the exercise number' if len(argv) > 2 else f'no such file: {path}'} "
              f"(python tests/exercises/run.py {number} [your_file.py])", file=sys.stderr)
        return 2
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
