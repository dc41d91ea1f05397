"""The course checks itself: rerun each chapter's step script and compare what it prints with what
the chapter shows.

    .venv/bin/python scripts/tools/docs_check.py            # every chapter (make docs-check)
    .venv/bin/python scripts/tools/docs_check.py 08 09      # chapters whose file name starts so
    .venv/bin/python scripts/tools/docs_check.py --anchors  # only the line anchors and the README's chapter table
    ATEN_CPU_CAPABILITY=default .venv/bin/python scripts/tools/docs_check.py   # on ATen's plain kernels

A chapter marks each block of captured output with the command that printed it, on the line
before the block's fence:

    <!-- output: torchrun --nproc-per-node 2 scripts/course/step_08_plan.py -->

The command runs once (from the repository root, `torchrun` and `python` taken from this
interpreter's folder, stderr ignored). The block's lines must then appear in the fresh output in
the same order (other lines may come between: a chapter may quote part of the output, and a line
`...` stands for lines left out, such as a timeline measured on the author's machine). Two lines
match when their text is the same and their numbers agree:
  - a number followed by a unit of time or speed (s, ms, µs, tok/s), or a percentage after the
    word "measured" on its line, is a measurement of this machine: any value matches (a
    percentage before it, such as a schedule's theoretical idle fraction, is checked);
  - a number after "peak mem" or "bubble" (a training log's memory and idle time) is measured too,
    and so is a percentage in parentheses just after a time (`of 120 ms (32%)`: its share);
  - any other number must agree to 1e-6 relatively (or 1e-12 absolutely: float rounding); one in
    scientific notation (a gradient, an error) to one unit of its last printed digit: another
    CPU's kernels sum in another order, and a value near a rounding boundary may print one digit
    apart (`+5.0579e-04` on AVX2, `+5.0578e-04` on ATen's plain kernels). Bytes, counts, losses
    and MiB printed in fixed point stay exact.

Training logs. A block of `scripts/train.py` output is marked the same way, with the command a
reader runs. Its log goes to stdout; the progress bar on stderr is ignored. `--out` is replaced
by a fresh temporary folder (a second run must not resume the first's checkpoint), and the
folder's name is put back in the fresh output. So is the `--out` of a step script that writes
files (OUT_DEFAULTS: it refuses a folder that holds an earlier run's), given or not.
A long run may declare a cheaper equivalent at the end of its marker, `(checked on its first K
steps)`: the check then runs the same command with `--steps K`, which trains those K steps exactly
as the long run does (same data order, same warm-up learning rates), compares every shown line up
to step K (the `/K` of its step lines read as the shown total), and skips the shown `step N/...`
and `saved .../step_N` lines past K. A block with no line left to compare fails, so a check cannot
pass by skipping everything.

Generated prose. A number of the prose that the code computes (a planner's pick, a ratio, a count)
is not typed: the lines between `<!-- text: COMMAND -->` and `<!-- /text -->` are what COMMAND
prints, word for word and number for number (no measured number is let through, unlike a block),
and must appear in its fresh output in the same order. A typed number that the code no longer
prints fails the check.

Figures in prose. A figure of a chapter's prose (a number with a decimal point, a thousands comma or
four digits, or one followed by a unit or a percent sign) must be printed by one of the chapter's
checked blocks or generated paragraphs (equal once rounded to the digits the prose gives: "3.5" for a
printed 3.47; "1.2e-15" is one figure, its mantissa so rounded), or be declared typed on purpose,
with why, in a comment the chapter carries:
`<!-- typed: 3.4445 4.7750 2.0315 -- Newton-Schulz's coefficients (Jordan et al. 2024) -->`. So a
block brought up to date leaves no stale restatement of itself behind: the prose's old figure is
then printed nowhere, and the check names it. Years, settings (`--lr 3e-4`, `seq=4096`), section
marks and link targets are not figures. Checked on every run, with the anchors.

Line anchors. A link to a definition, `[name](../minipar/zero.py#L120)` or [`Class.method`](...),
must point at the line that defines it (`def name` or `class name`, the last dotted part); a
moved definition fails the check until the anchor is updated. Anchors are checked on every run,
in milliseconds; `--anchors` checks only them, and `--fix-anchors` first re-points each at its
definition's line now (in the same file: a definition moved to another file stays an error).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from minipar.course import readme_table

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"<!-- output: (.+?) -->")
TEXT = re.compile(r"<!-- text: (.+?) -->")  # generated prose, up to TEXT_END
TEXT_END = "<!-- /text -->"
CHEAPER = re.compile(r"\s*\(checked on its first (\d+) steps?\)$")
ANCHOR = re.compile(r"\[`?([\w.]+)(?:\([^`\]]*\))?`?\]\(([^)#\s]+\.py)#L(\d+)\)")  # [`name(args)`](f.py#L9)
MEASURED_AFTER = re.compile(r"(?:peak mem|bubble) $")  # a log's memory and idle time: this machine's
SHARE_AFTER = re.compile(r"ms \($")  # "of 120 ms (32%)": a measured time's share, measured too
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:e[-+]?\d+)?")
TIMING = re.compile(r" ?(?:s|ms|µs|us|ns|tok/s|GB/s)(?![\w=])")  # not "s=8" (a sequence length)


def blocks(chapter: Path) -> list[tuple[str, list[str]]]:
    """(command, the captured lines) of every marked block of a chapter (indented in a list or not)."""
    lines, found = chapter.read_text().splitlines(), []
    for i, line in enumerate(lines):
        mark = MARK.search(line)
        if mark and i + 1 < len(lines) and lines[i + 1].lstrip().startswith("```"):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].lstrip().startswith("```"))
            found.append((mark.group(1), lines[i + 2:end]))
    return found


def text_blocks(chapter: Path) -> list[tuple[str, list[str]]]:
    """(command, the prose lines) of every generated paragraph of a chapter, TEXT to TEXT_END."""
    lines, found = chapter.read_text().splitlines(), []
    for i, line in enumerate(lines):
        mark = TEXT.search(line)
        if mark:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == TEXT_END), None)
            if end is None:
                raise ValueError(f"{chapter.name}: {line.strip()} has no {TEXT_END} after it")
            found.append((mark.group(1), lines[i + 1:end]))
    return found


def first_text_mismatch(shown: list[str], fresh: list[str]) -> str | None:
    """None if the prose lines appear, each exactly, in order in the fresh output, else the first that does not."""
    at = 0
    for line in (s for s in shown if s.strip()):
        at = next((j + 1 for j in range(at, len(fresh)) if fresh[j].rstrip() == line.rstrip()), -1)
        if at < 0:
            return line
    return None


def last_digit(number: str) -> float:
    """One unit of the last digit of a number in scientific notation ("2.4435e-04": 1e-08); 0 for
    any other (fixed point is checked to 1e-6)."""
    mantissa, e, exponent = number.lower().partition("e")
    if not e or "." not in mantissa:
        return 0.0
    return 10.0 ** (int(exponent) - len(mantissa.split(".")[1]))


def parts(line: str) -> tuple[list[str], list[tuple[float, bool, float]]]:
    """A line's text between numbers, and its numbers (value, measured on this machine?, one unit
    of its last printed digit)."""
    texts, numbers, last = [], [], 0
    for m in NUMBER.finditer(line):
        texts.append(line[last:m.start()])
        measured = bool(TIMING.match(line, m.end()) or MEASURED_AFTER.search(line[:m.start()])) or (
            line.startswith("%", m.end()) and ("measured" in line[:m.start()] or SHARE_AFTER.search(line[:m.start()])))
        value = float(m.group().replace(",", "")) if m.group().strip(",.") else 0.0
        numbers.append((value, measured, last_digit(m.group())))
        last = m.end()
    texts.append(line[last:].rstrip())
    return texts, numbers


def same(shown: str, fresh: str) -> bool:
    (texts_a, nums_a), (texts_b, nums_b) = parts(shown), parts(fresh)
    if [t.strip() for t in texts_a] != [t.strip() for t in texts_b] or len(nums_a) != len(nums_b):
        return False
    return all(measured or math.isclose(a, b, rel_tol=1e-6, abs_tol=max(1e-12, digit * 1.000001))
               for (a, measured, digit), (b, _, _) in zip(nums_a, nums_b))


def first_mismatch(shown: list[str], fresh: list[str]) -> str | None:
    """None if the shown lines appear in order in the fresh output, else the first that does not."""
    at = 0
    for line in (s for s in shown if s.strip() not in ("", "...")):
        at = next((j + 1 for j in range(at, len(fresh)) if same(line, fresh[j])), -1)
        if at < 0:
            return line
    return None


def run(command: str) -> list[str]:
    """The command's stdout lines, run from the repository root (one line saying so if it failed)."""
    words = command.split()
    tool = Path(sys.executable).with_name(words[0]) if words[0] in ("torchrun", "python") else words[0]
    proc = subprocess.run([str(tool), *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
                               "WANDB_MODE": "disabled", "HOME": str(Path.home()),
                               "PYTHONPATH": str(ROOT),  # this checkout's minipar, whatever the venv installed
                               # ATEN_CPU_CAPABILITY=default docs_check.py: the chapters on another CPU's kernels
                               **{k: v for k, v in os.environ.items() if k == "ATEN_CPU_CAPABILITY"}})
    if proc.returncode != 0:  # the whole stderr kept: a rank's abort can lie far above torchrun's summary
        kept = Path(tempfile.mkstemp(prefix="docs_check_", suffix=".stderr")[1])
        kept.write_text(proc.stderr)
        return [f"(the command failed with exit code {proc.returncode}, its stderr in {kept}: "
                f"{proc.stderr.strip()[-300:]})"]
    return proc.stdout.splitlines()


def flag(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words[:-1] else None


# The step scripts that write a folder, and its default: checked with a fresh --out like train.py.
OUT_DEFAULTS = {"scripts/course/step_06_pipeline.py": "runs/step_06"}


def run_train(command: str, steps: int | None) -> list[str]:
    """A train.py command (or one of OUT_DEFAULTS), run into a fresh --out (and with --steps K when
    a cheaper check is declared); the fresh output reads as the shown command's: its folder, its
    total of steps."""
    words = command.split()
    out, total = flag(words, "--out"), flag(words, "--steps")
    default = next((d for script, d in OUT_DEFAULTS.items() if script in words), None)
    with tempfile.TemporaryDirectory(prefix="docs_check_") as tmp:
        fresh_out = str(Path(tmp) / "out")
        if out:
            words[words.index("--out") + 1] = fresh_out
        elif default:
            words, out = [*words, "--out", fresh_out], default
        if steps is not None:
            if total is None:
                return ["(a cheaper check needs the shown command to name --steps: add it)"]
            words[words.index("--steps") + 1] = str(steps)
        lines = run(" ".join(words))
    if out:
        lines = [line.replace(fresh_out, out) for line in lines]
    if steps is not None:
        lines = [re.sub(rf"^(step\s+\d+)/{steps}\b", rf"\g<1>/{total}", line) for line in lines]
    return lines


def within(line: str, steps: int | None) -> bool:
    """Whether a shown line is one the (cheaper) run prints: a step or a checkpoint up to `steps`."""
    if steps is None:
        return True
    step = re.match(r"\s*step\s+(\d+)/", line) or re.search(r"^saved .*step_(\d+)", line)
    return step is None or int(step.group(1)) <= steps


# A figure of the prose: 1.5, 1,051, 4096, 12 ms, 43%, 3x, 1.2e-15 (not 2024 or 1990: a year).
FIGURE = re.compile(r"(?<![\w.§#/=-])(\d+\.\d+e[-+]?\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d{4,}|"
                    r"\d+(?=\s?(?:%|×|x\b|[GMKT]i?B\b|ms\b|µs\b|s\b|[GTP]FLOPs?\b|hours?\b|tok/s)))(?![\w.,]*\d)")
YEAR = re.compile(r"(?:19|20)\d\d")
NOT_FIGURES = re.compile(r"<!--.*?-->|[Ee]xercises? [\d.]+\w*|\]\([^)]*\)|--[\w-]+[ =]\S+|\w+=\S+|§[\d.]+|arXiv:? ?[\d.]+|https?://\S+")
TYPED = re.compile(r"<!-- typed: (.+?) -- (.+?) -->")


def prose_lines(chapter: Path) -> list[tuple[int, str]]:
    """(line number, text) of a chapter's prose: outside fenced blocks, generated paragraphs and comments."""
    fenced = generated = False
    prose = []
    for lineno, line in enumerate(chapter.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif TEXT.search(line) or line.strip() == TEXT_END:
            generated = TEXT.search(line) is not None
        elif not fenced and not generated:
            prose.append((lineno, NOT_FIGURES.sub(" ", line)))
    return prose


def printed(figure: str, values: set[str]) -> bool:
    """A prose figure ("3.5", "1,051", "1.2e-15") is one of the printed numbers, once rounded to its digits."""
    if "e" in figure:  # scientific notation: the same mantissa to the digits the prose gives
        digits = len(figure.split("e")[0].split(".")[1])
        return any(f"{float(v):.{digits}e}" == f"{float(figure):.{digits}e}" for v in values)
    digits = len(figure.split(".")[1]) if "." in figure else 0
    want = float(figure.replace(",", ""))
    return any(math.isclose(round(float(v), digits), want, rel_tol=1e-12) for v in values)


def untied_figures(chapter: Path) -> list[str]:
    """Every figure of a chapter's prose that none of its checked blocks or generated paragraphs prints
    and that the chapter does not declare typed."""
    text = chapter.read_text()
    shown = [line for _, lines in blocks(chapter) + text_blocks(chapter) for line in lines]
    values = {n.replace(",", "") for line in shown for n in NUMBER.findall(line) if re.search(r"\d", n)}
    values = {v.lstrip("+") for v in values if re.fullmatch(r"-?\+?\d*\.?\d+(?:e[-+]?\d+)?", v.lstrip("+"))}
    values |= {str(float(v) * 100) for v in list(values)}  # 0.437 printed, "43.7%" written
    typed = {f for figures, _ in TYPED.findall(text) for f in figures.split()}
    errors = []
    for lineno, line in prose_lines(chapter):
        for figure in FIGURE.findall(line):
            if YEAR.fullmatch(figure) or figure in typed or printed(figure, values):
                continue
            errors.append(f"{chapter.name}:{lineno}: {figure} is printed by no checked block of the chapter "
                          f"(generate it, show it, or declare it `<!-- typed: {figure} -- why -->`)")
    return errors


def anchor_errors(doc: Path) -> list[str]:
    """Every link `[name](path.py#Ln)` in a Markdown file whose line n does not define `name`."""
    errors = []
    for lineno, text in enumerate(doc.read_text().splitlines(), 1):
        for name, path, line in ANCHOR.findall(text):
            target = (doc.parent / path).resolve()
            lines = target.read_text().splitlines() if target.is_file() else []
            defined = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name.split('.')[-1])}\b")
            if not 0 < int(line) <= len(lines) or not defined.match(lines[int(line) - 1]):
                errors.append(f"{doc.name}:{lineno}: {path}#L{line} does not define {name}")
    return errors


def definition_line(target: Path, name: str) -> int | None:
    """The line that defines `name` in a file (for `Class.method`, the first after `class Class`)."""
    lines = target.read_text().splitlines() if target.is_file() else []
    owner, last = name.split(".")[0], name.split(".")[-1]
    start = next((i for i, line in enumerate(lines) if "." in name and re.match(rf"class\s+{owner}\b", line)), 0)
    defined = re.compile(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(last)}\b")
    return next((i + 1 for i in range(start, len(lines)) if defined.match(lines[i])), None)


def fix_anchors(doc: Path) -> None:
    """Point every anchor of a Markdown file at its definition's line now, in the same file."""
    def fixed(m: re.Match) -> str:
        line = definition_line((doc.parent / m.group(2)).resolve(), m.group(1))
        return m.group(0) if line is None else m.group(0).replace(f"#L{m.group(3)})", f"#L{line})")
    doc.write_text(ANCHOR.sub(fixed, doc.read_text()))


def check_outputs(chapters: list[Path]) -> int:
    """Run each marked block's command once and compare; the number of stale blocks."""
    outputs: dict[tuple[str, int | None], list[str]] = {}
    failed = 0
    for chapter in chapters:
        for marked, shown in text_blocks(chapter):
            if (marked, None) not in outputs:
                print(f"running {marked}", flush=True)
                outputs[marked, None] = run(marked)
            miss = first_text_mismatch(shown, outputs[marked, None]) if any(x.strip() for x in shown) \
                else "(the generated text is empty)"
            failed += miss is not None
            print(f"  {chapter.name}: " + ("OK (text)" if miss is None else f"STALE TEXT: no fresh line is {miss!r}"))
        for marked, shown in blocks(chapter):
            cheaper = CHEAPER.search(marked)
            command, steps = CHEAPER.sub("", marked), int(cheaper.group(1)) if cheaper else None
            if (command, steps) not in outputs:
                print(f"running {command}" + (f" (its first {steps} step(s))" if cheaper else ""), flush=True)
                train = {"scripts/train.py", *OUT_DEFAULTS} & set(command.split())
                outputs[command, steps] = run_train(command, steps) if train else run(command)
            fresh = outputs[command, steps]
            checked = [line for line in shown if within(line, steps)]
            empty = all(line.strip() in ("", "...") for line in checked)
            miss = "(no line of the block is checked)" if empty else first_mismatch(checked, fresh)
            failed += miss is not None
            broken = fresh[:1] if fresh and fresh[0].startswith(("(the command failed", "(a cheaper")) else None
            print(f"  {chapter.name}: " + ("OK" if miss is None else broken[0] if broken else
                                           f"STALE: no fresh line matches {miss!r}"))
    return failed


README = ROOT / "README.md"
TABLE_MARK = "<!-- chapter table: written from minipar/course.py"


def with_chapter_table(text: str) -> str:
    """The README's text with its chapter table (the lines after TABLE_MARK's, up to a blank line)
    written from the course's map."""
    start = text.index("\n", text.index(TABLE_MARK)) + 1
    end = text.index("\n\n", start) + 1
    return text[:start] + readme_table() + text[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixes", nargs="*", default=[""], help="chapters whose file name starts so (all)")
    parser.add_argument("--anchors", action="store_true", help="check only the line anchors (no command runs)")
    parser.add_argument("--fix-anchors", action="store_true",
                        help="first re-point each anchor at its definition's current line (same file), then check")
    parser.add_argument("--write-table", action="store_true",
                        help="first write the README's chapter table from minipar/course.py, then check")
    args = parser.parse_args(argv)
    if args.write_table:
        README.write_text(with_chapter_table(README.read_text()))
    stale_table = README.read_text() != with_chapter_table(README.read_text())
    print("the README's chapter table is not minipar/course.py's: run docs_check.py --write-table" if stale_table
          else "the README's chapter table is minipar/course.py's")
    chapters = sorted(p for p in (ROOT / "docs").glob("*.md") if any(p.name.startswith(x) for x in args.prefixes))
    for doc in chapters + [ROOT / "README.md"] if args.fix_anchors else []:
        fix_anchors(doc)
    anchors = [e for doc in chapters + [ROOT / "README.md"] for e in anchor_errors(doc)]
    for error in anchors:
        print(f"  ANCHOR: {error}")
    print(f"{len(anchors)} broken line anchor(s)" if anchors else "every line anchor points at its definition")
    untied = [e for doc in chapters if doc.name[0].isdigit() for e in untied_figures(doc)]
    for error in untied:
        print(f"  FIGURE: {error}")
    print(f"{len(untied)} figure(s) of the prose printed by no block" if untied
          else "every figure of the prose is printed by a checked block or declared typed")
    failed = 0 if args.anchors else check_outputs(chapters)
    if not args.anchors:
        print(f"{failed} stale block(s)" if failed else "every captured block matches a fresh run")
    return 1 if failed or anchors or untied or stale_table else 0


if __name__ == "__main__":
    sys.exit(main())
