"""The exercises of docs/exercises/ can be failed: each checker passes the library's answer (or one
built from its public pieces), fails the skeleton a student starts from, saying "not implemented
yet" rather than dumping a traceback, and fails one plausible wrong answer, naming what differs.
The answers are in tests/exercises/answers/."""

import sys
from pathlib import Path

import pytest
from harness import run_ranks

sys.path.insert(0, str(Path(__file__).parent / "exercises"))
import checks  # noqa: E402

ANSWERS = Path(__file__).parent / "exercises" / "answers"

# number: a phrase the wrong answer's report must contain (it says what differs)
WRONG_SAYS = {
    1: "the result is not the sum over ranks",
    2: "differs from the whole batch's gradient on one device: max abs diff",
    3: "after step 1 the parameters differ from Adam on one device",
    4: "the output y differs from one device's: max abs diff",
    5: "do not hold every position exactly once",
    6: "GPipe runs every forward before any backward",
    7: "is idle less than that",
    8: "under 1F1B, 1 is not it",
}


@pytest.mark.parametrize("number", sorted(checks.EXERCISES))
def test_exercise_checker_passes_the_library_answer(number):
    assert checks.check(number, ANSWERS / f"ex{number}_reference.py", run_ranks) == []


@pytest.mark.parametrize("number", sorted(checks.EXERCISES))
def test_exercise_checker_fails_the_skeleton_as_not_implemented_yet(number):
    problems = checks.check(number, None, run_ranks)
    assert problems and all("not implemented yet" in p or "not answered yet" in p for p in problems), problems
    assert not any("Traceback" in p for p in problems)


@pytest.mark.parametrize("number", sorted(checks.EXERCISES))
def test_exercise_checker_fails_a_plausible_wrong_answer_and_says_what_differs(number):
    problems = checks.check(number, ANSWERS / f"ex{number}_wrong.py", run_ranks)
    assert any(WRONG_SAYS[number] in p for p in problems), problems


def test_ring_exercise_passes_uneven_chunks_and_fails_half_the_bytes():
    """A ring with uneven chunks (length 7 on 2-4 ranks) passes; the wrong answer's ledger shows
    (N-1)/N * S per rank, not 2(N-1)/N * S, and the checker says so by rank."""
    assert checks.check(1, ANSWERS / "ex1_uneven.py", run_ranks) == []
    results = run_ranks(2, checks._ring_rank_guarded, str(ANSWERS / "ex1_wrong.py"))
    assert any("rank 1: N=2, length 12 (96 bytes): sent 48 bytes" in p for p in checks._ring_bytes_problems(2, results))


def test_make_exercise_lists_the_exercises_and_prints_pass_or_fail(capsys, monkeypatch):
    import harness

    # run.main ends with harness.shutdown(), as `make exercise` must; here that would close the session's
    # pools of every world size, and each later test would pay to start its ranks again. Its own pools.
    monkeypatch.setattr(harness, "_pools", {})
    run = checks.load(Path(__file__).parent / "exercises" / "run.py")  # by path: "run" is a common name
    assert run.main([]) == 0
    assert "docs/exercises/ex6_gpipe.py" in capsys.readouterr().out
    assert run.main(["6", str(ANSWERS / "ex6_reference.py")]) == 0
    assert "PASS" in capsys.readouterr().out
    assert run.main(["5", str(ANSWERS / "ex5_wrong.py")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "cp=1, seq_len=6: the ranks do not hold every position exactly once" in out


def test_the_zero1_checkers_adam_is_torchs_adam():
    """Exercise 3's one-device reference is Adam written out; it must be torch.optim.Adam's update."""
    import torch
    torch.manual_seed(0)
    start = torch.randn(10, dtype=torch.float64)
    theirs, mine, state = torch.nn.Parameter(start.clone()), start.clone(), {}
    adam = torch.optim.Adam([theirs], lr=0.1)
    for step in range(1, 4):
        grad = torch.randn(10, dtype=torch.float64)
        theirs.grad = grad.clone()
        adam.step()
        checks.adam_by_hand(mine, grad, state, step, 0.1)
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-12, atol=1e-14)
