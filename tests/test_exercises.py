"""The exercises of docs/exercises/ can be failed: each checker passes the library's answer (or one
built from its public pieces), fails the skeleton a student starts from, saying "not implemented
yet" (or "not answered yet") rather than dumping a traceback, and fails one plausible wrong answer,
naming what differs. The answers are in tests/exercises/answers/."""

import sys
from pathlib import Path

import pytest
from harness import run_ranks

sys.path.insert(0, str(Path(__file__).parent / "exercises"))
import checks  # noqa: E402
import checks_collectives  # noqa: E402
from check_common import load  # noqa: E402

ANSWERS = Path(__file__).parent / "exercises" / "answers"


def answer(number: str, which: str) -> Path:
    return ANSWERS / f"ex{number.replace('.', '_')}_{which}.py"


# number: a phrase the wrong answer's report must contain (it says what differs)
WRONG_SAYS = {
    "0.1": "303,892 bytes, the estimator says 196,480 (fewer",
    "0.2": "not the small model's activations at 8 x 256 tokens, in MiB: the library's is more",
    "0.3": "the library's is more",
    "1.1": "the result is not the sum over ranks",
    "1.2": "all_reduce: 3145728 is not it, the library's is more",
    "1.3": "N for 64 MiB: 32 is not it, the library's is less",
    "2.1": "differs from the whole batch's gradient on one device: max abs diff",
    "2.2": "the ledger shows 4 all-reduces of",
    "2.3": "all-reduces at --bucket-mb 0.25: 28 is not it",
    "3.1": "after step 1 the parameters differ from Adam on one device",
    "3.2": "under ZeRO-3, in MiB: the library's is more",
    "3.3": "the library's is more",
    "4.1": "the output y differs from one device's: max abs diff",
    "4.2": "at tp 4, over what it sends at tp 2: the library's is more",
    "4.3": "at tp 2, in MiB: the library's is less",
    "5.1": "do not hold every position exactly once",
    "5.2": "the library's is more",
    "5.3": "the library's is less",
    "6.1": "GPipe runs every forward before any backward",
    "6.2": "the library's is less (run scripts/step_06_pipeline.py",
    "6.3": "under 1F1B: 1 is not it",
    "6.4": "the library's is less",
    "7.1": "the output differs from the plain MoE layer's on one device: max abs diff",
    "7.2": "the library's is more",
    "7.3": "the library's is less",
    "8.1": "stage=2",
    "8.2": "not --dp 8 --zero 3",
    "8.3": "the library's is more",
    "9.1": "dp: [5, 7] is not it",
    "9.2": "not --dp 16 --zero 3",
    "9.3": "not the dimensions whose groups span two nodes",
}


def test_every_exercise_has_its_file_a_reference_a_wrong_answer_and_a_claim():
    assert set(WRONG_SAYS) == set(checks.EXERCISES)
    for number, (name, *_) in checks.EXERCISES.items():
        assert name.startswith(f"ex{number.replace('.', '_')}_"), name
        assert (checks.EXERCISES_DIR / name).exists() and answer(number, "reference").exists(), number
        assert answer(number, "wrong").exists(), number


def test_every_chapter_0_to_9_has_three_exercises_and_1_to_8_implement_and_predict_or_explore():
    kinds: dict[str, set] = {}
    for number, (_, kind, *_) in checks.EXERCISES.items():
        kinds.setdefault(number.split(".")[0], []).append(kind)
    assert sorted(kinds) == [str(c) for c in range(10)]
    assert all(len(k) >= 3 for k in kinds.values()), kinds
    assert all("implement" in kinds[str(c)] and {"predict", "explore"} & set(kinds[str(c)]) for c in range(1, 9))


@pytest.mark.parametrize("number", sorted(checks.EXERCISES))
def test_exercise_checker_passes_the_library_answer(number):
    assert checks.check(number, answer(number, "reference"), run_ranks) == []


@pytest.mark.parametrize("number", sorted(checks.EXERCISES))
def test_exercise_checker_fails_the_skeleton_as_not_implemented_yet(number):
    problems = checks.check(number, None, run_ranks)
    assert problems and all("not implemented yet" in p or "not answered yet" in p for p in problems), problems
    assert not any("Traceback" in p for p in problems)


@pytest.mark.parametrize("number", sorted(checks.EXERCISES))
def test_exercise_checker_fails_a_plausible_wrong_answer_and_says_what_differs(number):
    problems = checks.check(number, answer(number, "wrong"), run_ranks)
    assert any(WRONG_SAYS[number] in p for p in problems), problems


def test_ring_exercise_passes_uneven_chunks_and_fails_half_the_bytes():
    """A ring with uneven chunks (length 7 on 2-4 ranks) passes; the wrong answer's ledger shows
    (N-1)/N * S per rank, not 2(N-1)/N * S, and the checker says so by rank."""
    assert checks.check("1.1", answer("1.1", "uneven"), run_ranks) == []
    results = run_ranks(2, checks_collectives._ring_rank_guarded, str(answer("1.1", "wrong")))
    assert any("rank 1: N=2, length 12 (96 bytes): sent 48 bytes" in p
               for p in checks_collectives._ring_bytes_problems(2, results))


def test_make_exercise_lists_the_exercises_and_prints_pass_or_fail(capsys, monkeypatch):
    import harness

    # run.main ends with harness.shutdown(), as `make exercise` must; here that would close the session's
    # pools of every world size, and each later test would pay to start its ranks again. Its own pools.
    monkeypatch.setattr(harness, "_pools", {})
    run = load(Path(__file__).parent / "exercises" / "run.py")  # by path: "run" is a common name
    assert run.main([]) == 0
    out = capsys.readouterr().out
    assert "docs/exercises/ex6_1_gpipe.py" in out and "9.3" in out and "explore" in out
    assert run.main(["6.1", str(answer("6.1", "reference"))]) == 0
    assert "PASS" in capsys.readouterr().out
    assert run.main(["5.1", str(answer("5.1", "wrong"))]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "cp=1, seq_len=6: the ranks do not hold every position exactly once" in out
    assert run.main(["6"]) == 2  # a chapter alone is not an exercise: the list, and exit 2


def test_the_zero1_checkers_adam_is_torchs_adam():
    """Exercise 3.1's one-device reference is Adam written out; it must be torch.optim.Adam's update."""
    import torch
    torch.manual_seed(0)
    start = torch.randn(10, dtype=torch.float64)
    theirs, mine, state = torch.nn.Parameter(start.clone()), start.clone(), {}
    adam = torch.optim.Adam([theirs], lr=0.1)
    for step in range(1, 4):
        grad = torch.randn(10, dtype=torch.float64)
        theirs.grad = grad.clone()
        adam.step()
        checks_collectives.adam_by_hand(mine, grad, state, step, 0.1)
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-12, atol=1e-14)
