"""scripts/tools/docs_check.py: the rules by which a chapter's captured output matches a fresh run."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_check", ROOT / "scripts" / "tools" / "docs_check.py")
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


def test_a_training_log_masks_memory_and_bubble_and_a_cheaper_run_skips_later_steps():
    shown = "step     1/10 | loss 8.3321 | 2,308 tok/s | peak mem 351 MiB | bubble 51% | sent 6.75 MiB/step"
    assert docs_check.same(shown, shown.replace("351", "76").replace("51%", "44%").replace("2,308", "97"))
    assert not docs_check.same(shown, shown.replace("6.75", "6.76"))  # bytes sent are not a measurement
    assert not docs_check.same(shown, shown.replace("8.3321", "8.3322"))
    comm = shown + " | comm exposed 38 ms of 120 ms (32%): dp 13 ms, tp 25 ms"  # times, and a time's share
    assert docs_check.same(comm, comm.replace("38 ms", "9.1 ms").replace("32%", "8%").replace("13 ms", "0.42 ms"))
    assert not docs_check.same(comm, comm.replace(", tp 25 ms", ""))  # the kinds that waited are the layout's
    assert not docs_check.same("dW 19.03 ms (1 matmul(s))", "dW 19.03 ms (3 matmul(s))")  # only a share, a %
    # scientific notation: one unit of the last digit apart is another CPU's rounding, two are not
    grads = "    single device, all rows     +2.4435e-04 +5.0579e-04 -2.0834e-04"
    assert docs_check.same(grads, grads.replace("5.0579e-04", "5.0578e-04").replace("2.0834", "2.0833"))
    assert not docs_check.same(grads, grads.replace("5.0579e-04", "5.0577e-04"))
    assert not docs_check.same(grads, grads.replace("5.0579e-04", "5.0579e-05"))
    assert docs_check.within("step     1/10 | loss 8.3321", 1)
    assert not docs_check.within("step    10/10 | loss 7.8514", 1)
    assert not docs_check.within("saved /tmp/ch6/step_000010", 1) and docs_check.within("saved /tmp/ch6/step_000001", 1)
    assert docs_check.within("mesh pp2 x dp2 x cp1 x tp2 = 8 ranks", 1) and docs_check.within("step 10/10", None)
    marked = "torchrun --nproc-per-node 2 scripts/train.py --steps 10 (checked on its first 1 step)"
    assert docs_check.CHEAPER.search(marked).group(1) == "1"


def test_a_line_anchor_passes_on_its_definition_and_fails_once_it_moves(tmp_path):
    (tmp_path / "pkg").mkdir()
    code = tmp_path / "pkg" / "mod.py"
    source = "def gpipe(p, m):\n    return []\n\n\nclass Pipeline:\n    def run(self):\n        pass\n"
    code.write_text("import torch\n\n\n" + source)
    doc = tmp_path / "docs" / "ch.md"
    doc.parent.mkdir()
    doc.write_text("[`gpipe(p, m)`](../pkg/mod.py#L4), [`Pipeline.run`](../pkg/mod.py#L9) [Pipeline](../pkg/mod.py#L8)")
    assert docs_check.anchor_errors(doc) == []
    code.write_text("import torch\n\n\n\n" + source)
    errors = docs_check.anchor_errors(doc)  # one blank line more: every definition moved down by one
    assert len(errors) == 3 and "#L4 does not define gpipe" in errors[0], errors
    docs_check.fix_anchors(doc)  # --fix-anchors: re-pointed at the lines that define them now
    assert docs_check.anchor_errors(doc) == [] and "mod.py#L10)" in doc.read_text()
    doc.write_text("[`gpipe`](../pkg/mod.py#L5) [`gone`](../pkg/missing.py#L1) [`gpipe`](../pkg/mod.py#L99)\n")
    assert [e.split(": ", 1)[1] for e in docs_check.anchor_errors(doc)] == [
        "../pkg/missing.py#L1 does not define gone", "../pkg/mod.py#L99 does not define gpipe"]


def test_every_line_anchor_in_the_course_points_at_its_definition():
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    assert [e for d in docs for e in docs_check.anchor_errors(d)] == []
    assert sum(len(docs_check.ANCHOR.findall(d.read_text())) for d in docs) >= 20  # the chapters link their key code


def test_generated_prose_fails_once_a_number_typed_in_it_is_not_what_the_code_prints(tmp_path):
    chapter = tmp_path / "99_x.md"
    chapter.write_text("A lesson.\n\n<!-- text: python scripts/course/step_08c_roofline.py --prose -->\n"
                       "The pick spends 1.4 s on tp against 43.7 s of compute (3.1%).\n<!-- /text -->\n")
    [(command, shown)] = docs_check.text_blocks(chapter)
    assert command == "python scripts/course/step_08c_roofline.py --prose"
    fresh = ["(c) ...", "The pick spends 1.4 s on tp against 43.7 s of compute (3.1%)."]
    assert docs_check.first_text_mismatch(shown, fresh) is None
    # the planner now picks another layout: the typed figures are stale, and unlike an output block's,
    # a time in generated prose is not let through as this machine's measurement
    moved = [line.replace("1.4 s", "3.5 s").replace("3.1%", "9.8%") for line in fresh]
    assert docs_check.first_text_mismatch(shown, moved) == shown[0]
    slower = [line.replace("1.4 s", "3.5 s").replace("43.7 s", "35.4 s") for line in fresh]
    assert docs_check.first_text_mismatch(shown, slower) == shown[0]
    assert docs_check.same(shown[0], slower[1])  # the output-block rule would have let the times through
    chapter.write_text("<!-- text: python scripts/x.py -->\nno end\n")
    with pytest.raises(ValueError, match="has no <!-- /text -->"):
        docs_check.text_blocks(chapter)


def test_every_generated_paragraph_names_a_script_that_exists_and_chapter_8_has_one():
    generated = {}
    for chapter in (ROOT / "docs").glob("*.md"):
        for command, lines in docs_check.text_blocks(chapter):
            script = next(w for w in command.split() if w.endswith(".py"))
            assert (ROOT / script).exists(), (chapter.name, command)
            assert any(line.strip() for line in lines), (chapter.name, command)
            generated[chapter.name] = generated.get(chapter.name, 0) + 1
    assert generated.get("08_memory_and_planning.md", 0) >= 1


PROSE_LINES = 400  # a chapter reads in the time the README gives it (issue 40): about 400 lines of prose


def prose_lines(text: str) -> int:
    """Non-blank lines outside fenced blocks (code and captured output aside), markers left out."""
    count, fenced = 0, False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.strip() and not line.lstrip().startswith("<!--"):
            count += 1
    return count


def test_every_chapter_is_at_most_about_400_lines_of_prose():
    assert prose_lines("a\n```\nb\nc\n```\n\n<!-- output: x -->\nd\n") == 2
    chapters = sorted(p for p in (ROOT / "docs").glob("[01]*.md"))
    assert len(chapters) >= 15
    long = {p.name: n for p in chapters if (n := prose_lines(p.read_text())) > PROSE_LINES}
    assert not long, f"over {PROSE_LINES} lines of prose (move measurement diaries to docs/benchmarks.md): {long}"


def test_a_figure_of_the_prose_must_be_printed_by_a_block_of_its_chapter_or_declared_typed(tmp_path):
    chapter = tmp_path / "99_planted.md"
    block = ("<!-- output: python scripts/course/step_00_one_device.py -->\n"
             "```\nstep time 3.47 s, 1051 params, 0.437, off by 2.14e-17\n```\n")
    chapter.write_text(block + "It takes 3.5 s for 1,051 parameters, 43.7% of them, to 2.1e-17, in 2024 "
                               "(exercise 11.1).\n")
    assert docs_check.untied_figures(chapter) == []  # rounded, comma'd, as a percentage, in e-notation: printed
    chapter.write_text(block + "Off by 2.2e-17.\n")
    errors = docs_check.untied_figures(chapter)  # e-notation is read whole, not as its mantissa 2.2
    assert len(errors) == 1 and ":5: 2.2e-17 is printed by no checked block" in errors[0], errors
    chapter.write_text(block.replace("3.47", "4.02") + "It takes 3.5 s (`--lr 3e-4`, seq=4096).\n")
    errors = docs_check.untied_figures(chapter)  # the block brought up to date: the prose's 3.5 is stale
    assert len(errors) == 1 and ":5: 3.5 is printed by no checked block" in errors[0], errors
    chapter.write_text(chapter.read_text() + "<!-- typed: 3.5 -- a planted constant, with why -->\n")
    assert docs_check.untied_figures(chapter) == []
    chapter.write_text("<!-- text: python x.py -->\nIt holds 7.25 GiB.\n<!-- /text -->\nA 12 ms step.\n")
    errors = docs_check.untied_figures(chapter)  # the generated paragraph is not prose; "12 ms" is
    assert len(errors) == 1 and ":4: 12 is printed by no checked block" in errors[0], errors
    chapter.write_text(block.replace("0.437", "1.2e-15") + "Equal to 1.2e-15, not 1.3e-15.\n")
    errors = docs_check.untied_figures(chapter)  # scientific notation: the whole figure, its mantissa's digits
    assert len(errors) == 1 and ":5: 1.3e-15 is printed by no checked block" in errors[0], errors


def test_every_figure_of_the_courses_prose_is_printed_by_its_chapter_or_declared_typed():
    """The rule above on the course itself (docs_check.py checks it on every run, in milliseconds)."""
    chapters = [c for c in sorted((ROOT / "docs").glob("*.md")) if c.name[0].isdigit()]
    assert len(chapters) >= 15
    assert [e for c in chapters for e in docs_check.untied_figures(c)] == []
    typed = [t for c in chapters for t in docs_check.TYPED.findall(c.read_text())]
    assert typed and all(why.strip() for _, why in typed)  # each typed figure says why
