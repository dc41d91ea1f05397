"""The exercises of docs/exercises/ can be failed: each checker passes an answer written out (never a
call of the library's own function, which the implement checkers switch off), fails the skeleton a
student starts from, saying "not implemented yet" (or "not answered yet") rather than dumping a
traceback, and fails every wrong answer of its catalogue (the plausible mistakes: off by one, the
wrong group, blocking where asynchronous is asked, the right result by the wrong traffic, a call of
the library's answer), naming what differs. The answers are in tests/exercises/answers/."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import run_ranks

sys.path.insert(0, str(Path(__file__).parent / "exercises"))
import checks  # noqa: E402
import checks_collectives  # noqa: E402
import checks_fault_tolerance  # noqa: E402
from check_common import Predict, load  # noqa: E402

ANSWERS = Path(__file__).parent / "exercises" / "answers"


def answer(number: str, which: str) -> Path:
    return ANSWERS / f"ex{number.replace('.', '_')}_{which}.py"


OFF = "is off in this exercise"

# The catalogue of wrong answers: number -> {answer file (tests/exercises/answers/ex<N>_<file>.py):
# a phrase its report must contain (it says what differs, or what the algorithm did instead)}.
WRONG_SAYS = {
    "0.1": {"wrong": "303,892 bytes, the estimator says 196,480 (fewer", "wrong_views": "285,444 bytes",
            "wrong_estimator": "activation_bytes " + OFF},
    "0.2": {"wrong": "not the small model's activations at"},
    "0.3": {"wrong": "the library's is more"},
    "1.1": {"wrong": "the result is not the sum over ranks",
            "wrong_delegates": "minipar.collectives.ring_all_reduce " + OFF,
            "wrong_torch_all_reduce": "torch.distributed.all_reduce " + OFF,
            "wrong_everyone": "the ranks sent [1, 1] messages, expected 2(N-1) = 2 each",
            "wrong_gather_index": "N=2, length 12: the result is not the sum over ranks",
            "wrong_formula": "bytes_sent_per_rank(1200, 2) = 600.0: not what the ring sends"},
    "1.2": {"wrong": "is not it, the library's is more"},
    "1.3": {"wrong": "N for 64 MiB: 17 is not it, the library's is more"},
    "2.1": {"wrong": "(it is 2 times the right one: summed, not averaged?)",
            "wrong_world_size": "(it is 0.5 times the right one: divided by the world's size, not the group's?)",
            "wrong_unledgered": "the ledger shows no all_reduce on the group",
            "wrong_every_grad": "expected each gradient all-reduced once, 1696 bytes over 4 parameters",
            "wrong_delegates": "minipar.data_parallel.DataParallel " + OFF},
    "2.2": {"wrong": "the ledger shows 4 all-reduces of [32, 512, 128, 1024] bytes, expected one per bucket",
            "wrong_blocking": "all_reduce #0 was blocking (async_op=False): backward stood still",
            "wrong_wait_in_hook": "the handle of all_reduce #0 was waited for during backward",
            "wrong_at_finish": "no all-reduce started before backward's last gradient was ready",
            "wrong_forward_order": "all-reduces of [32, 640, 1024] bytes, expected one per bucket: [672, 1024]",
            "wrong_off_by_one": "bucket_bytes=544: the ledger shows 2 all-reduces of [672, 1024] bytes, expected "
                                "one per bucket: [544, 1152]",
            "wrong_no_divide": "summed, not averaged?",
            "wrong_delegates": "minipar.data_parallel.bucket_params " + OFF},
    "2.3": {"wrong": "all-reduces at --bucket-mb 0.25: 28 is not it"},
    "3.1": {"wrong": "after step 1 the parameters differ from Adam on one device",
            "wrong_all_reduce": "the ledger shows all_gather x3 (576 bytes), all_reduce x3 (576 bytes), 288 bytes "
                                "sent per step; expected per step one reduce_scatter and one all_gather",
            "wrong_plain_dp": "2 of them of all P = 24 (Adam's m and v over the whole vector?) (state_numel() says 24)",
            "wrong_full_state": "the optimizer holds 2 tensors of 48 numbers besides flat_param",
            "wrong_world_size": "dp=2 (its group: ranks [0, 1] of 4; the group, not the world): after step 1"},
    "3.2": {"wrong": "under ZeRO-3, in MiB (the"},
    "3.3": {"wrong": "the library's is more"},
    "4.1": {"wrong": "the output y differs from one device's: max abs diff",
            "wrong_no_f": "x.grad differs from one device's",
            "wrong_gather_weights": "forward: the ledger shows [('all_gather', 384), ('all_gather', 384)] on the "
                                    "group, expected one all_reduce",
            "wrong_f_and_g_swapped": "the output y differs from one device's",
            "wrong_delegates": "minipar.tensor_parallel.ColumnParallelLinear " + OFF},
    "4.2": {"wrong": "at tp 4, over what it sends at tp 2: the library's is more"},
    "4.3": {"wrong": "in MiB: the library's is less"},
    "5.1": {"wrong": "do not hold every position exactly once",
            "wrong_contiguous": "cp=2, seq_len=8: unequal causal work per rank [10, 26]",
            "wrong_order": "positions [3, 4, 5, 0, 1, 2], expected [0, 1, 2, 3, 4, 5]",
            "wrong_delegates": "minipar.context_parallel.zigzag_positions " + OFF,
            "wrong_split_sequence": "minipar.context_parallel.split_sequence " + OFF},
    "5.2": {"wrong": "the library's is more"},
    "5.3": {"wrong": "the library's is less"},
    "6.1": {"wrong": "GPipe runs every forward before any backward",
            "wrong_reverse_backward": "the Bs are not in micro-batch order: [2, 1, 0]",
            "wrong_stage": "expected each of F0..F0 and B0..B0 of stage 1 once",
            "wrong_delegates": "minipar.pipeline.schedules.gpipe " + OFF,
            "wrong_build": "minipar.pipeline.schedules.gpipe " + OFF},
    "6.2": {"wrong": "is the bubble ratio (p - 1)/m, idle time over the work alone"},
    "6.3": {"wrong": "under 1F1B: 1 is not it"},
    "6.4": {"wrong": "the library's is less"},
    "7.1": {"wrong": "the output differs from the plain MoE layer's on one device: max abs diff",
            "wrong_no_grad": "x.grad differs from one device's",
            "wrong_gather_all": "forward: the ledger shows [('all_gather', 960), ('reduce_scatter', 960)] on the ep "
                                "group, expected the all-to-all of this rank's 20 (token, expert) rows",
            "wrong_delegates": "minipar.expert_parallel.expert_parallel_dispatch " + OFF},
    "7.2": {"wrong": "the library's is more"},
    "7.3": {"wrong": "the library's is less"},
    "8.1": {"wrong": "stage=2", "wrong_off_by_one": "stage=1",
            "wrong_delegates": "minipar.zero.model_state_bytes " + OFF},
    "8.2": {"wrong": "--cp 2 --zero 3 (the planner ranks another first"},
    "8.3": {"wrong": "the library's is more"},
    "9.1": {"wrong": "is not it (mesh.py: tp varies fastest"},
    "9.2": {"wrong": "--sp (the cheapest within"},
    "9.3": {"wrong": "not the dimensions whose groups span two nodes"},
    "10b.1": {"wrong": "half an interval on average, not a whole one"},
    "10b.2": {"wrong_step_first": "step 1: optimizer.step() ran before manager.should_commit() was asked",
              "wrong_always_steps": "step 3 (the try that fails: its allreduce errs, should_commit() says False): "
                                    "optimizer.step() ran although manager.should_commit() returned False",
              "wrong_no_average": "step 1: the gradients of ['hidden.weight', 'hidden.bias', 'out.weight', "
                                  "'out.bias'] were not averaged over the replica groups",
              "wrong_weights_only": "step 1: the gradients of ['hidden.bias', 'out.bias'] were not averaged",
              "wrong_vote_first": "step 1: manager.should_commit() was asked before the last manager.allreduce",
              "wrong_no_wait": "step 1: the allreduce of ['hidden.weight', 'hidden.bias', 'out.weight', 'out.bias'] "
                               "was never waited for",
              "wrong_keeps_grads": "step 3 (the try that fails: its allreduce errs, should_commit() says False): "
                                   "when ft_step returned, the gradients of ['hidden.weight', 'hidden.bias', "
                                   "'out.weight', 'out.bias'] were still there",
              "wrong_delegates": "minipar.extras.replicas.Replicas.gate " + OFF,
              "wrong_train_step": "minipar.run.train.train_step " + OFF},
    "11.1": {"wrong_keeps_all": "the cheap ops' outputs are kept too",
             "wrong_recomputes_matmuls": "ran again in backward, the most expensive ops redone",
             "wrong_full_layer": "something expensive is not kept",
             "wrong_mlp": "ran again in backward, the most expensive ops redone",
             "wrong_delegates": "minipar.parallelize.recompute_layers " + OFF},
}
CATALOGUE = [(number, which) for number, answers in sorted(WRONG_SAYS.items()) for which in answers]


def test_every_exercise_has_its_file_a_reference_and_a_catalogue_of_wrong_answers():
    assert set(WRONG_SAYS) == set(checks.EXERCISES)
    for number, (name, kind, *_) in checks.EXERCISES.items():
        assert name.startswith(f"ex{number.replace('.', '_')}_"), name
        assert (checks.EXERCISES_DIR / name).exists() and answer(number, "reference").exists(), number
        files = {f.stem.split("_", 2)[2] for f in ANSWERS.glob(f"ex{number.replace('.', '_')}_*.py")}
        assert files == {"reference", *WRONG_SAYS[number]}, (number, files)  # every file in the catalogue
        if kind == "implement":  # the algorithm's mistakes, not only one: a catalogue
            assert len(WRONG_SAYS[number]) >= 3, number


def test_every_chapter_0_to_9_has_three_exercises_and_1_to_8_implement_and_predict_or_explore():
    kinds: dict[str, set] = {}
    for number, (_, kind, *_) in checks.EXERCISES.items():
        kinds.setdefault(number.split(".")[0], []).append(kind)
    assert sorted(kinds) == sorted([str(c) for c in range(10)] + ["10b", "11"])  # 11: the capstone's one project
    assert kinds.pop("11") == ["implement"]
    assert sorted(kinds.pop("10b")) == ["implement", "predict"]  # fault tolerance: the vote, and what it saves
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


@pytest.mark.parametrize("number,which", CATALOGUE)
def test_exercise_checker_fails_each_wrong_answer_of_the_catalogue_saying_what_differs(number, which):
    problems = checks.check(number, answer(number, which), run_ranks)
    assert any(WRONG_SAYS[number][which] in p for p in problems), problems


def test_ring_exercise_counts_the_bytes_of_a_ring_that_stops_halfway():
    """The reference's ring (uneven chunks where N does not divide) sends 2(N-1)/N * S by the ledger;
    a reduce-scatter alone sends half, and the checker says so by rank."""
    results = run_ranks(2, checks_collectives._ring_rank_guarded, str(answer("1.1", "reference")))
    assert checks_collectives._ring_bytes_problems(2, results) == []
    results[1]["sent"][12] = (48, 1)  # what the wrong answer's ledger shows: (N-1)/N * S, one message
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
    assert run.main(["6"]) == 2  # a chapter alone is not an exercise: one line on stderr, the list on stdout, exit 2
    said = capsys.readouterr()
    assert said.err == "run.py: no exercise '6': give one of those below\n" and "ex6_1_gpipe.py" in said.out
    assert run.main(["1.1", "missing.py"]) == 2  # one line, not an AttributeError
    assert capsys.readouterr().err.startswith("run.py: no such file: missing.py (python tests/exercises/run.py 1.1")
    assert run.main(["6.1 5.1"]) == 1  # make exercise N='6.1 5.1': each in turn; 5.1's skeleton fails
    out = capsys.readouterr().out
    assert "exercise 6.1" in out and "exercise 5.1" in out


def test_make_exercise_takes_a_chapter_like_10b(capsys, monkeypatch):
    """Chapter 10b's numbers (10b.1, 10b.2) are listed, and checked by number; the predict one prints
    its variant's question first."""
    import harness

    monkeypatch.setattr(harness, "_pools", {})  # as above: run.main's shutdown closes its own pools only
    run = load(Path(__file__).parent / "exercises" / "run.py")
    assert run.main([]) == 0
    out = capsys.readouterr().out
    assert "10b.1" in out and "docs/exercises/ex10b_2_commit_step.py" in out
    assert run.main(["10b.1", str(answer("10b.1", "reference"))]) == 0
    out = capsys.readouterr().out
    assert "exercise 10b.1, your variant: seed" in out and "PASS" in out
    assert run.main(["10b.2"]) == 1  # the skeleton
    assert "ft_step: not implemented yet" in capsys.readouterr().out


def test_the_commit_checkers_fake_manager_passes_the_librarys_own_protocol(monkeypatch):
    """Replicas.gate (one flat allreduce per dtype, then the vote) passes exercise 10b.2's checker
    once it is switched on again: the fake Manager is the torchft that the library's answer expects,
    and its refusal, not the fake, is what fails the answer that delegates to it."""
    monkeypatch.setattr(checks_fault_tolerance, "COMMIT_OFF", ())
    assert checks_fault_tolerance.check_commit_step(answer("10b.2", "wrong_delegates")) == []


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


# The predict exercises, and the explore ones whose case is drawn from a seed too (8.2)
PREDICTS = {n: c for n, (_, kind, _, c, _) in checks.EXERCISES.items() if isinstance(c, Predict)}


@pytest.mark.parametrize("number", sorted(PREDICTS))
def test_predict_reference_passes_every_variant_and_the_wrong_answer_fails_each(number):
    """The reference answers compute ANSWER(v) from the variant's numbers (a formula, not the key's
    own function): right for every variant; the wrong answer wrong for every one, saying so."""
    predict = PREDICTS[number]
    reference, wrong = load(answer(number, "reference")).ANSWER, load(answer(number, "wrong")).ANSWER
    for v in predict.space:
        assert predict.problems(reference(SimpleNamespace(**v)), v) == [], v
        problems = predict.problems(wrong(SimpleNamespace(**v)), v)
        assert any(WRONG_SAYS[number]["wrong"] in p for p in problems), (v, problems)


def test_predict_variant_comes_from_the_seed_and_make_exercise_prints_it():
    """The seed picks the variant (the file's SEED, else the user name's); `asked` names both."""
    predict, skeleton = PREDICTS["6.2"], checks.EXERCISES_DIR / checks.EXERCISES["6.2"][0]
    variants = {str(predict.variant(seed)) for seed in range(40)}
    assert len(variants) > len(predict.space) // 2  # two students rarely share one
    question = checks.asked("6.2", skeleton, seed=7)
    v = predict.variant(7)
    assert f"seed 7 (given): GPipe on p = {v['p']} stages with m = {v['m']} micro-batches" in question
    assert "from your user name" in checks.asked("6.2", skeleton)
    assert checks.check("6.2", answer("6.2", "reference"), seed=7) == []


def test_no_predict_answer_is_printed_in_the_chapters():
    """A prediction is asked before its answer is shown: no variant's key, as the chapters would
    print it, appears anywhere in docs/ (the chapters, the exercises' README and files)."""
    docs = Path(__file__).parents[1] / "docs"
    text = "\n".join(f.read_text() for f in [*docs.glob("*.md"), *docs.glob("exercises/*")] if f.is_file())
    printed = [(n, v, k) for n, c in PREDICTS.items() for v in c.space for k in c.keys(v) if k in text]
    assert not printed, printed
