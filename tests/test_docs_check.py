"""scripts/docs_check.py: the rules by which a chapter's captured output matches a fresh run."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_check", ROOT / "scripts" / "docs_check.py")
docs_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_check)


def test_numbers_must_agree_but_timings_and_measured_percentages_may_differ():
    same = docs_check.same
    assert same("step 1 | loss 8.3321 | 5,481 tok/s | 12.5 ms", "step 1 | loss 8.3321 | 6,002 tok/s | 9.1 ms")
    assert same("idle: theory 27.3%   measured 54.6% (13%, 9%)", "idle: theory 27.3%   measured 46.8% (43%, 57%)")
    assert not same("idle fraction: theory 20.0%, simulated 20.0%", "idle fraction: theory 11.1%, simulated 11.1%")
    assert not same("mesh pp1 x dp4 x cp1 x tp1 = 4 ranks", "mesh pp1 x dp2 x cp1 x tp2 = 4 ranks")
    assert not same("b=2 s=8 h=32", "b=2 s=16 h=32")  # s= is a length, not seconds
    assert same("max |diff| 4e-17", "max |diff| 0.0e+00")  # float rounding: absolutely below 1e-12
    assert not same("loss 8.3321", "loss 8.3322")
    assert not same("rank 0 holds 7.00 MiB", "rank 0 holds 7.01 MiB")
    assert not same("equal: True", "equal: False")


def test_a_block_may_quote_part_of_the_output_but_in_order():
    fresh = ["(a) one", "  skipped", "(b) two", "(c) three"]
    assert docs_check.first_mismatch(["(a) one", "(c) three"], fresh) is None
    assert docs_check.first_mismatch(["(c) three", "(a) one"], fresh) == "(a) one"


def test_every_marked_block_names_a_script_that_exists():
    marked = 0
    for chapter in (ROOT / "docs").glob("*.md"):
        for command, lines in docs_check.blocks(chapter):
            script = next(w for w in command.split() if w.endswith(".py"))
            assert (ROOT / script).exists(), (chapter.name, command)
            assert lines, (chapter.name, command)
            marked += 1
        # a marker that no fence follows (or an indented one the reader missed) would be skipped silently
        assert len(docs_check.blocks(chapter)) == len(re.findall(docs_check.MARK, chapter.read_text())), chapter.name
    assert marked >= 5
    text = (ROOT / "docs" / "09_4d.md").read_text()
    assert len(re.findall(docs_check.MARK, text)) == 5


def test_every_test_the_docs_name_exists():
    defined = {m for f in (ROOT / "tests").rglob("test_*.py") for m in re.findall(r"def (test_\w+)", f.read_text())}
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        named = set(re.findall(r"`(test_\w+)`", doc.read_text())) | set(re.findall(r"::(test_\w+)`", doc.read_text()))
        assert named <= defined, (doc.name, sorted(named - defined))
