"""The course checks itself: rerun each chapter's step script and compare what it prints with what
the chapter shows.

    .venv/bin/python scripts/docs_check.py            # every chapter (make docs-check)
    .venv/bin/python scripts/docs_check.py 08 09      # chapters whose file name starts so

A chapter marks each block of captured output with the command that printed it, on the line
before the block's fence:

    <!-- output: torchrun --nproc-per-node 2 scripts/step_08_plan.py -->

The command runs once (from the repository root, `torchrun` and `python` taken from this
interpreter's folder, stderr ignored). The block's lines must then appear in the fresh output in
the same order (other lines may come between: a chapter may quote part of the output, and a line
`...` stands for lines left out, such as a timeline measured on the author's machine). Two lines
match when their text is the same and their numbers agree:
  - a number followed by a unit of time or speed (s, ms, µs, tok/s), or a percentage after the
    word "measured" on its line, is a measurement of this machine: any value matches (a
    percentage before it, such as a schedule's theoretical idle fraction, is checked);
  - any other number must agree to 1e-6 relatively (or 1e-12 absolutely: float rounding).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!-- output: (.+?) -->")
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:e[-+]?\d+)?")
TIMING = re.compile(r" ?(?:s|ms|µs|us|tok/s)(?![\w=])")  # not "s=8" (a sequence length)


def blocks(chapter: Path) -> list[tuple[str, list[str]]]:
    """(command, the captured lines) of every marked block of a chapter (indented in a list or not)."""
    lines, found = chapter.read_text().splitlines(), []
    for i, line in enumerate(lines):
        mark = MARK.search(line)
        if mark and i + 1 < len(lines) and lines[i + 1].lstrip().startswith("```"):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].lstrip().startswith("```"))
            found.append((mark.group(1), lines[i + 2:end]))
    return found


def parts(line: str) -> tuple[list[str], list[tuple[float, bool]]]:
    """A line's text between numbers, and its numbers (value, measured on this machine?)."""
    texts, numbers, last = [], [], 0
    for m in NUMBER.finditer(line):
        texts.append(line[last:m.start()])
        measured = bool(TIMING.match(line, m.end())) or (
            line.startswith("%", m.end()) and "measured" in line[:m.start()])
        numbers.append((float(m.group().replace(",", "")) if m.group().strip(",.") else 0.0, measured))
        last = m.end()
    texts.append(line[last:].rstrip())
    return texts, numbers


def same(shown: str, fresh: str) -> bool:
    (texts_a, nums_a), (texts_b, nums_b) = parts(shown), parts(fresh)
    if [t.strip() for t in texts_a] != [t.strip() for t in texts_b] or len(nums_a) != len(nums_b):
        return False
    return all(measured or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
               for (a, measured), (b, _) in zip(nums_a, nums_b))


def first_mismatch(shown: list[str], fresh: list[str]) -> str | None:
    """None if the shown lines appear in order in the fresh output, else the first that does not."""
    at = 0
    for line in (s for s in shown if s.strip() not in ("", "...")):
        at = next((j + 1 for j in range(at, len(fresh)) if same(line, fresh[j])), -1)
        if at < 0:
            return line
    return None


def run(command: str) -> list[str]:
    words = command.split()
    tool = Path(sys.executable).with_name(words[0]) if words[0] in ("torchrun", "python") else words[0]
    proc = subprocess.run([str(tool), *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
                               "WANDB_MODE": "disabled", "HOME": str(Path.home())})
    if proc.returncode != 0:
        return [f"(the command failed with exit code {proc.returncode}: {proc.stderr.strip()[-300:]})"]
    return proc.stdout.splitlines()


def main(argv=None) -> int:
    prefixes = (argv if argv is not None else sys.argv[1:]) or [""]
    chapters = sorted(p for p in (ROOT / "docs").glob("*.md") if any(p.name.startswith(x) for x in prefixes))
    outputs: dict[str, list[str]] = {}
    failed = 0
    for chapter in chapters:
        for command, shown in blocks(chapter):
            if command not in outputs:
                print(f"running {command}", flush=True)
                outputs[command] = run(command)
            fresh = outputs[command]
            miss = first_mismatch(shown, fresh)
            failed += miss is not None
            broken = fresh[:1] if fresh and fresh[0].startswith("(the command failed") else None
            print(f"  {chapter.name}: " + ("OK" if miss is None else broken[0] if broken else
                                           f"STALE: no fresh line matches {miss!r}"))
    print(f"{failed} stale block(s)" if failed else "every captured block matches a fresh run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
