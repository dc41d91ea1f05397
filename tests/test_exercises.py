"""The exercises of docs/exercises/ can be failed: each checker passes an answer written out (never a
call of the library's own function, which the implement checkers switch off), fails the skeleton a
student starts from, saying "not implemented yet" (or "not answered yet") rather than dumping a
traceback, passes the right answers it once refused, and fails every wrong answer of its catalogue
(the plausible mistakes: off by one, the wrong group, blocking where asynchronous is asked, the
right result by the wrong traffic or order; the library's answer by each route: an import, a
re-export, a reload, a sibling, its source executed, the reference run; a prediction that is code,
or found by bisecting), naming what differs. The answers are in tests/exercises/answers/."""

import ast
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import run_ranks

sys.path.insert(0, str(Path(__file__).parent / "exercises"))
import check_common  # noqa: E402
import checks  # noqa: E402
import checks_answers_4_9  # noqa: E402
import checks_collectives  # noqa: E402
import checks_fault_tolerance  # noqa: E402
from check_common import Predict, load  # noqa: E402

from minipar import course  # noqa: E402

ANSWERS = Path(__file__).parent / "exercises" / "answers"


@pytest.fixture(autouse=True)
def tries_kept_apart(tmp_path, monkeypatch):
    """A predict exercise's tries are kept per user (~/.cache/minipar); each test keeps its own."""
    monkeypatch.setattr(check_common, "TRIES_FILE", tmp_path / "exercise_tries.json")


def answer(number: str, which: str) -> Path:
    return ANSWERS / f"ex{number.replace('.', '_')}_{which}.py"


OFF = "is off in this exercise"

# The catalogue of wrong answers: number -> {answer file (tests/exercises/answers/ex<N>_<file>.py):
# a phrase its report must contain (it says what differs, or what the algorithm did instead)}.
WRONG_SAYS = {
    "0.1": {"wrong": "303,892 bytes, the estimator says 196,480 (fewer", "wrong_views": "285,444 bytes",
            "wrong_estimator": "activation_bytes " + OFF},
    "0.2": {"wrong": "not the small model's activations at"},
    "0.3": {"wrong": ": wrong ("},
    "1.1": {"wrong": "the result is not the sum over ranks",
            "wrong_delegates": "minipar.collectives.ring_all_reduce " + OFF,
            "wrong_torch_all_reduce": "torch.distributed.all_reduce " + OFF,
            "wrong_everyone": "the ranks sent [1, 1] messages, expected 2(N-1) = 2 each",
            "wrong_gather_index": "N=2, length 12: the result is not the sum over ranks",
            "wrong_direct": "rank 0: N=3, length 12: sent to ranks [1, 2]: not a ring",
            "wrong_formula": "bytes_sent_per_rank(1200, 2) = 600.0: not what the ring sends"},
    "1.2": {"wrong": "is not it (bytes one rank sends by the ring"},
    "1.3": {"wrong": "N for 64 MiB: 17 is not it"},
    "2.1": {"wrong": "(it is 2 times the right one: summed, not averaged?)",
            "wrong_world_size": "(it is 0.5 times the right one: divided by the world's size, not the group's?)",
            "wrong_unledgered": "the ledger shows no all_reduce on the group",
            "wrong_every_grad": "expected each gradient all-reduced once, 1696 bytes over 4 parameters",
            "wrong_delegates": "minipar.data_parallel.DataParallel " + OFF},
    "2.2": {"wrong": "the ledger shows 5 all-reduces of [32, 512, 128, 1024, 64] bytes, expected one per bucket",
            "wrong_blocking": "all_reduce #0 was blocking (async_op=False): backward stood still",
            "wrong_wait_in_hook": "the handle of all_reduce #0 was waited for during backward",
            "wrong_at_finish": "no all-reduce started before backward's last gradient was ready",
            "wrong_forward_order": "all-reduces of [1568, 192] bytes, expected one per bucket: [1216, 544]",
            "wrong_off_by_one": "bucket_bytes=192: the ledger shows 2 all-reduces of [544, 1216] bytes, expected "
                                "one per bucket: [192, 1024, 544]",
            "wrong_no_divide": "summed, not averaged?",
            "wrong_delegates": "minipar.data_parallel.bucket_params " + OFF,
            "wrong_last_param": "bucket_bytes=600: tied.gate.grad differs from the whole batch's gradient"},
    "2.3": {"wrong": "all-reduces at --bucket-mb 0.25: 28 is not it"},
    "3.1": {"wrong": "after step 1 the parameters differ from Adam on one device",
            "wrong_all_reduce": "the ledger shows all_gather x3 (576 bytes), all_reduce x3 (576 bytes), 288 bytes "
                                "sent per step; expected per step one reduce_scatter and one all_gather",
            "wrong_plain_dp": "2 of them of all P = 24 (Adam's m and v over the whole vector?) (state_numel() says 24)",
            "wrong_full_state": "the optimizer holds 2 tensors of 48 numbers besides flat_param",
            "wrong_world_size": "dp=2 (its group: ranks [0, 1] of 4; the group, not the world): after step 1",
            "wrong_partial": "the optimizer holds 2 tensors of 48 numbers besides flat_param (allocated in its "
                             "construction and steps, still alive after them), 2 of them of all P = 24"},
    "3.2": {"wrong": "under ZeRO-3, in MiB (the"},
    "3.3": {"wrong": ": wrong ("},
    "4.1": {"wrong": "the output y differs from one device's: max abs diff",
            "wrong_no_f": "x.grad differs from one device's",
            "wrong_gather_weights": "forward: the ledger shows [('all_gather', 384), ('all_gather', 384)] on the "
                                    "group, expected one all_reduce",
            "wrong_f_and_g_swapped": "the output y differs from one device's",
            "wrong_delegates": "minipar.tensor_parallel.ColumnParallelLinear " + OFF},
    "4.2": {"wrong": "at tp 4, over what it sends at tp 2: wrong"},
    "4.3": {"wrong": "in MiB: wrong"},
    "4c.1": {"wrong_shard_alone": "this rank's slice of the orthogonalised matrices differs from one device's",
             "wrong_everyone": "gathering everything to everyone sends each rank every matrix",
             "wrong_delegates": "minipar.muon.Muon.owner_pieces " + OFF,
             "wrong_reload": "minipar.muon.Muon.owner_pieces " + OFF,
             "wrong_reexport": "minipar.muon.Muon.owner_pieces " + OFF},
    "4c.2": {"wrong": "not what Muon's gather adds per rank and step, in MiB"},
    "5.1": {"wrong": "do not hold every position exactly once",
            "wrong_contiguous": "cp=2, seq_len=8: unequal causal work per rank [10, 26]",
            "wrong_order": "positions [3, 4, 5, 0, 1, 2], expected [0, 1, 2, 3, 4, 5]",
            "wrong_delegates": "minipar.context_parallel.zigzag_positions " + OFF,
            "wrong_split_sequence": "minipar.context_parallel.split_sequence " + OFF},
    "5.2": {"wrong": ": wrong ("},
    "5.3": {"wrong": ": wrong ("},
    "6.1": {"wrong": "GPipe runs every forward before any backward",
            "wrong_reverse_backward": "the Bs are not in micro-batch order: [2, 1, 0]",
            "wrong_stage": "expected each of F0..F0 and B0..B0 of stage 1 once",
            "wrong_delegates": "minipar.pipeline.schedules.gpipe " + OFF,
            "wrong_build": "minipar.pipeline.schedules.gpipe " + OFF},
    "6.2": {"wrong": "is the bubble ratio (p - 1)/m, idle time over the work alone"},
    "6.3": {"wrong": "under 1F1B: 1 is not it"},
    "6.4": {"wrong": ": wrong (", "wrong_float": "ANSWER = 27: not the fewest micro-batches"},
    "7.1": {"wrong": "the output differs from the plain MoE layer's on one device: max abs diff",
            "wrong_no_grad": "x.grad differs from one device's",
            "wrong_gather_all": "forward: the ledger shows [('all_gather', 960), ('reduce_scatter', 960)] on the ep "
                                "group, expected the all-to-all of this rank's 20 (token, expert) rows",
            "wrong_delegates": "minipar.expert_parallel.expert_parallel_dispatch " + OFF},
    "7.2": {"wrong": ": wrong ("},
    "7.3": {"wrong": ": wrong ("},
    "8.1": {"wrong": "stage=2", "wrong_off_by_one": "stage=1",
            "wrong_delegates": "minipar.zero.model_state_bytes " + OFF},
    "8.2": {"wrong": "--cp 2 --zero 3 (the planner ranks another first"},
    "8.3": {"wrong": ": wrong ("},
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
              "wrong_sibling": "minipar.run.train.train_step " + OFF,  # the loop's step: a sibling of the gate
              "wrong_votes_twice": "step 1: manager.should_commit() was asked 2 times",
              "wrong_vote_before_wait": "step 1: manager.should_commit() was asked before the gradients' allreduces "
                                        "were waited for"},
    "11.1": {"wrong_keeps_all": "the cheap ops' outputs are kept too",
             "wrong_recomputes_matmuls": "ran again in backward, the most expensive ops redone",
             "wrong_full_layer": "something expensive is not kept",
             "wrong_mlp": "ran again in backward, the most expensive ops redone",
             "wrong_delegates": "minipar.parallelize.recompute_layers " + OFF},
}
# Right answers other than the reference, which the checkers once refused (issue 40): each must pass.
RIGHT = {"2.2": ("right_queue_callback",),  # waits in a callback queued on autograd's engine, as DDP does
         "10b.2": ("right_logs_loss",)}  # all-reduces its loss for the log too, as minipar's replica groups do
RIGHT_ANSWERS = [(number, which) for number, answers in sorted(RIGHT.items()) for which in answers]

# Delegation by each route (issue 40): a re-export, importlib.reload (or a fresh import), a sibling that
# computes the answer, the library's source executed again, the reference answer run.
OFF_AT = {"0.1": "minipar.planning.estimate.", "1.1": "minipar.collectives.", "2.1": "minipar.data_parallel.",
          "2.2": "minipar.data_parallel.", "3.1": "minipar.zero.", "4.1": "minipar.tensor_parallel.",
          "5.1": "minipar.context_parallel.", "6.1": "minipar.pipeline.schedules.",
          "7.1": "minipar.expert_parallel.", "8.1": "minipar.zero.", "10b.2": "minipar.extras.replicas.",
          "11.1": "minipar.parallelize."}
DELEGATES = {
    "0.1": {"wrong_reexport": "activation_bytes", "wrong_reload": "activation_bytes",
            "wrong_sibling": "layer_activation_bytes",
            "wrong_step_script": "step_00_one_device.kept_for_backward " + OFF},  # the chapter's script's count
    "1.1": {"wrong_reexport": "all_reduce", "wrong_reload": "ring_all_reduce",
            "wrong_sibling": "torch.distributed.all_reduce " + OFF},
    "2.1": {"wrong_reexport": "DataParallel", "wrong_reload": "DataParallel",
            "wrong_sibling": "minipar.zero.ZeroDataParallel " + OFF},
    "2.2": {"wrong_reexport": "bucket_params", "wrong_reload": "bucket_params",
            "wrong_sibling": "minipar.zero.bucket_plan " + OFF},
    "3.1": {"wrong_delegates": "ZeroDataParallel", "wrong_reexport": "ZeroDataParallel",
            "wrong_reload": "ZeroDataParallel",
            "wrong_sibling": "minipar.zero3.Zero3DataParallel " + OFF},
    "4.1": {"wrong_reexport": "ColumnParallelLinear", "wrong_reload": "ColumnParallelLinear",
            "wrong_sibling": "ParallelMLP"},
    "5.1": {"wrong_reexport": "split_sequence", "wrong_reload": "zigzag_positions",
            "wrong_fresh_import": "zigzag_positions"},
    "6.1": {"wrong_reload": "gpipe", "wrong_sibling": "one_f_one_b",
            "wrong_exec_source": "reading minipar/pipeline/schedules.py is off in this exercise",
            "wrong_runs_reference": "reading tests/exercises/answers/ex6_1_reference.py is off in this exercise",
            "wrong_reads_reference": "reading tests/exercises/answers/ex6_1_reference.py is off in this exercise"},
    "7.1": {"wrong_reload": "expert_parallel_dispatch", "wrong_reexport": "minipar.moe.MoE " + OFF},
    "8.1": {"wrong_reload": "model_state_bytes", "wrong_sibling": "minipar.precision.model_state_bytes " + OFF},
    "10b.2": {"wrong_reload": "Replicas.gate"},
    "11.1": {"wrong_reload": "recompute_layers", "wrong_reexport": "recompute_layers",  # parallelize, held elsewhere
             "wrong_sibling": "keep_expensive",  # the library's policy, which torch calls back in the checker's step
             "wrong_exec_source": "reading minipar/parallelize.py is off in this exercise",
             "wrong_runs_reference": "reading tests/exercises/answers/ex11_1_reference.py is off in this exercise",
             "wrong_reads_reference": "reading tests/exercises/answers/ex11_1_reference.py is off in this exercise"},
}
for _number, _says in DELEGATES.items():
    for _which, _what in _says.items():  # a bare name: the library's function of that name, off
        WRONG_SAYS[_number][_which] = _what if " " in _what else f"{OFF_AT[_number]}{_what} {OFF}"

# Every predict exercise (and the explore ones drawn from a seed): ANSWER as code that computes it
NOT_CODE = "a prediction is a number (or a choice) written out, not code that computes it"
for _number, (_, _, _, _checker, _) in checks.EXERCISES.items():
    if isinstance(_checker, Predict):
        WRONG_SAYS[_number]["wrong_callable"] = NOT_CODE
WRONG_SAYS["8.3"]["wrong_checker_key"] = NOT_CODE  # the checker's key, called when the file loads

CATALOGUE = [(number, which) for number, answers in sorted(WRONG_SAYS.items()) for which in answers]


def test_every_exercise_has_its_file_a_reference_and_a_catalogue_of_wrong_answers():
    assert set(WRONG_SAYS) == set(checks.EXERCISES)
    for number, (name, kind, *_) in checks.EXERCISES.items():
        assert name.startswith(f"ex{number.replace('.', '_')}_"), name
        assert (checks.EXERCISES_DIR / name).exists() and answer(number, "reference").exists(), number
        files = {f.stem.split("_", 2)[2] for f in ANSWERS.glob(f"ex{number.replace('.', '_')}_*.py")}
        assert files == {"reference", *WRONG_SAYS[number], *RIGHT.get(number, ())}, (number, files)
        if kind == "implement":  # the algorithm's mistakes, not only one: a catalogue
            assert len(WRONG_SAYS[number]) >= 3, number


# An exercise uses its own chapter's tools and earlier ones' (minipar/course.py's map, the order
# tests/test_structure.py holds the library to): a chapter-3 table is not built with chapter 8's estimator
# or chapter 10's TrainConfig. The starters, the reference and right answers, and the wrong answers that
# make a plausible mistake are held to it; the wrong answers that reach the library's answer by a route
# (their report says it "is off") are not: they take it from wherever a student could find it.
LIBRARY = Path(course.__file__).parent


def _library_file(module: str) -> str | None:
    """The file under minipar/ of module `module` (minipar.planning.estimate), or None if it is none."""
    parts = module.split(".")
    if parts[0] != "minipar":
        return None
    for tail in ("/".join(parts[1:]) + ".py", "/".join([*parts[1:], "__init__.py"])):
        if (LIBRARY / tail).is_file():
            return tail
    return None


def later_chapter_imports(path: Path, number: str) -> list[str]:
    """Each minipar module that `path`, an exercise of chapter `number.split('.')[0]`, imports anywhere in
    it (at the top, in a function, under `if __name__`) which a later chapter teaches: 'module (chapter)'."""
    chapter, found = number.split(".")[0], []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]  # `from minipar import moe` too
        else:
            continue
        for name in names:
            while name and _library_file(name) is None:  # minipar.zero.model_state_bytes -> minipar.zero
                name = name.rpartition(".")[0]
            if name and course.ORDER[taught := course.chapter_of(_library_file(name)).number] > course.ORDER[chapter]:
                found.append(f"{name} ({taught})")
    return sorted(set(found))


def _exercise_files() -> list[tuple[Path, str]]:
    """(file, exercise number) of every exercise starter and every answer of tests/exercises/answers/."""
    files = [(checks.EXERCISES_DIR / name, number) for number, (name, *_) in checks.EXERCISES.items()]
    for path in sorted(ANSWERS.glob("ex*.py")):
        chapter, _, rest = path.stem[2:].partition("_")  # ex4c_1_reference: 4c, 1_reference
        files.append((path, f"{chapter}.{rest.partition('_')[0]}"))
    return files


def _routes_to_the_library() -> set[Path]:
    return {answer(number, which) for number, says in WRONG_SAYS.items() for which, said in says.items()
            if "is off in this exercise" in said}


def test_no_exercise_imports_a_later_chapters_module():
    routes, late = _routes_to_the_library(), {}
    for path, number in _exercise_files():
        if path not in routes and (found := later_chapter_imports(path, number)):
            late[f"{path.relative_to(check_common.ROOT)} (chapter {number.split('.')[0]})"] = found
    assert late == {}, late


def test_an_exercises_import_of_a_later_chapter_is_found_wherever_it_is(tmp_path):
    """The check above could fail: a planted chapter-3 file that builds its table with chapter 8's
    estimator and chapter 10's TrainConfig (in its `__main__` block, in a function) is caught; its own
    chapter's and earlier ones' imports are not."""
    planted = tmp_path / "ex3_3_explore_planted.py"
    planted.write_text("import minipar.zero\nfrom minipar.model import get_config\nfrom minipar import zero3\n"
                       "if __name__ == '__main__':\n    from minipar.planning.estimate import peak_bytes\n"
                       "def table():\n    from minipar import layout\n    import minipar.run.config\n"
                       "    from minipar.precision import widths\n")
    assert later_chapter_imports(planted, "3.3") == ["minipar.layout (8)", "minipar.planning.estimate (8)",
                                                     "minipar.precision (3b)", "minipar.run.config (10)"]
    assert later_chapter_imports(planted, "10.1") == []
    assert (checks.EXERCISES_DIR / "ex3_3_explore_zero3_dp.py", "3.3") in _exercise_files()
    assert (answer("11.1", "wrong_reexport"), "11.1") in _exercise_files()  # 4c, 10b: the chapter's own number
    assert (answer("4c.1", "reference"), "4c.1") in _exercise_files()


def test_every_chapter_0_to_9_has_three_exercises_and_1_to_8_implement_and_predict_or_explore():
    kinds: dict[str, set] = {}
    for number, (_, kind, *_) in checks.EXERCISES.items():
        kinds.setdefault(number.split(".")[0], []).append(kind)
    assert sorted(kinds) == sorted([str(c) for c in range(10)] + ["4c", "10b", "11"])  # 11: the capstone's one project
    assert sorted(kinds.pop("4c")) == ["implement", "predict"]  # Muon: the owner step, and what gather adds
    assert kinds.pop("11") == ["implement"]
    assert sorted(kinds.pop("10b")) == ["implement", "predict"]  # fault tolerance: the vote, and what it saves
    assert all(len(k) >= 3 for k in kinds.values()), kinds
    assert all("implement" in kinds[str(c)] and {"predict", "explore"} & set(kinds[str(c)]) for c in range(1, 9))


def test_the_catalogue_holds_each_kind_of_wrong_answer():
    """Each implement exercise (the capstone's too): the algorithm's mistakes (a wrong result, the
    right one by the wrong traffic or order), and the library's answer by an import, a reload, and a
    re-export or a sibling; each predict exercise: an ANSWER that is code (and a test
    bisects each: test_predict_cannot_be_bisected_...)."""
    for number, (_, kind, _, checker, _) in checks.EXERCISES.items():
        says = WRONG_SAYS[number]
        if kind == "implement":
            mistakes = [w for w, said in says.items() if OFF not in said and "is off in this exercise" not in said]
            assert len(mistakes) >= 2, number  # a wrong result, and a right one by the wrong traffic or order
            assert {"wrong_reload"} <= set(says) and {"wrong_reexport", "wrong_sibling"} & set(says), number
            assert any(w in says for w in ("wrong_delegates", "wrong_estimator")), number  # the plain import
        if isinstance(checker, Predict):
            assert says.get("wrong_callable") == NOT_CODE, number


@pytest.mark.parametrize("number", sorted(checks.EXERCISES))
def test_exercise_checker_passes_the_library_answer(number):
    assert checks.check(number, answer(number, "reference"), run_ranks) == []


@pytest.mark.parametrize("number,which", RIGHT_ANSWERS)
def test_exercise_checker_passes_each_right_answer_other_than_the_reference(number, which):
    assert checks.check(number, answer(number, which), run_ranks) == []


def test_explore_microbatches_key_is_exact_28_not_floats_27():
    """1F1B at p = 4: 3/(m + 3), exactly 1/10 at m = 27, which is not under 10%."""
    assert checks_answers_4_9.truth_microbatches_for_bubble() == 28
    assert checks.check("6.4", answer("6.4", "reference")) == []
    assert checks.check("6.4", answer("6.4", "wrong_float")) != []


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
    reference, wrong = load(answer(number, "reference")).formula, load(answer(number, "wrong")).formula
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
    assert checks.check("6.2", answer("6.2", "reference")) == []  # its SEED, 0: the variant it writes out


def test_no_predict_answer_is_printed_in_the_chapters():
    """A prediction is asked before its answer is shown: no variant's key, as the chapters would
    print it, appears anywhere in docs/ (the chapters, the exercises' README and files)."""
    docs = Path(__file__).parents[1] / "docs"
    text = "\n".join(f.read_text() for f in [*docs.glob("*.md"), *docs.glob("exercises/*")] if f.is_file())
    printed = [(n, v, k) for n, c in PREDICTS.items() for v in c.space for k in c.keys(v) if k in text]
    assert not printed, printed


def answer_lines_shown(reference: Path, text: str, given: str = "") -> list[str]:
    """The lines of a reference answer's code (20 characters or more, comments, docstrings and imports left
    out, and the lines its starter `given` hands the student: a signature, a class statement) that appear,
    stripped, as a line of `text`."""
    shown = {line.strip() for line in text.splitlines()} - {line.strip() for line in given.splitlines()}
    code = [line.strip() for line in reference.read_text().splitlines()]
    return [c for c in code if len(c) >= 20 and not c.startswith(("#", '"""', "import ", "from ")) and c in shown]


def test_no_implement_answer_can_be_copied_from_the_chapters():
    """An answer copied from the course is not the answer: no line of an implement exercise's reference
    appears in docs/ (the chapters, the exercises' README and the other starter files: 0.3's once wrote out
    0.1's hook, and now calls chapter 0's script for it). What the chapters do show,
    the library's calls and simpler loops, are the catalogue's wrong answers: a delegation, or the wrong
    algorithm, traffic or order. And a prediction is never printed (the test above); 8.2's and 9.2's
    catalogues hold the chapter's own pick copied to another case."""
    docs = Path(__file__).parents[1] / "docs"
    text = "\n".join(f.read_text() for f in [*docs.glob("*.md"), *docs.glob("exercises/*")] if f.is_file())
    implements = [n for n, (_, kind, *_) in checks.EXERCISES.items() if kind == "implement"]
    assert len(implements) >= 13
    starter = {n: (checks.EXERCISES_DIR / checks.EXERCISES[n][0]).read_text() for n in implements}
    assert {n: shown for n in implements if (shown := answer_lines_shown(answer(n, "reference"), text, starter[n]))} \
        == {}
    planted = answer("6.1", "reference").read_text().splitlines()  # the check above can fail
    assert answer_lines_shown(answer("6.1", "reference"), text + "\n```\n" + "\n".join(planted) + "\n```")
    assert {"8.2", "9.2"} <= {n for n, says in WRONG_SAYS.items() if "wrong" in says}


def _another(x, i: int):
    """A wrong answer of the same shape as x, the i-th of several different ones."""
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, (int, float)):
        return x * (i + 2) + 1
    if isinstance(x, str):
        return next(c for c in "ABCDEFGH"[i:] + "ABCDEFGH" if c != x.upper()) if len(x) == 1 else f"{x}{'x' * (i + 1)}"
    if isinstance(x, (list, tuple)):
        return type(x)(_another(e, i) for e in x)
    return {k: _another(e, i) for k, e in x.items()}


@pytest.mark.parametrize("number", sorted(PREDICTS))
def test_predict_cannot_be_bisected_three_wrong_answers_per_variant_then_no_more(number, tmp_path):
    """A bisecting student is stopped: the feedback says wrong, never which way; after MAX_TRIES
    different wrong answers at a variant, not even the right one is checked there (the same wrong
    answer again costs nothing; another SEED, another variant, has its own tries)."""
    right = check_common.written_values(answer(number, "reference"))["ANSWER"]
    student = tmp_path / "student.py"

    def tried(value, seed=0):
        student.write_text(f"SEED = {seed}\nANSWER = {value!r}\n")
        return checks.check(number, student)

    for i in range(check_common.MAX_TRIES):
        problems = tried(_another(right, i))
        assert problems and problems[-1].endswith(f"[try {i + 1} of {check_common.MAX_TRIES} at this variant]")
        assert not any(way in p for p in problems for way in ("the library's is", "more than", "less than"))
        if i + 1 < check_common.MAX_TRIES:  # the same again: no try spent
            assert tried(_another(right, i))[-1].endswith(f"[try {i + 1} of {check_common.MAX_TRIES} at this variant]")
    assert tried(right) == [f"no tries left at this variant (seed 0): {check_common.MAX_TRIES} different wrong "
                            "answers were given; set SEED in the file to another whole number for a new variant, "
                            "and work it out first"]
    predict = PREDICTS[number]
    seed = next(s for s in range(1, 99) if predict.question(predict.variant(s)) != predict.question(predict.variant(0)))
    formula = load(answer(number, "reference")).formula
    assert tried(formula(SimpleNamespace(**predict.variant(seed))), seed) == []  # its own tries
    assert len(json.loads(check_common.TRIES_FILE.read_text())) == 1  # kept per variant, in the user's file


def test_predict_reads_the_answer_without_running_the_file(tmp_path):
    """ANSWER is read from the file's text: 3 / 7 is exact arithmetic of numbers; a name, a call or a
    function is code, and refused before anything of the file runs."""
    student = tmp_path / "student.py"
    student.write_text("raise SystemExit('the file was run')\nSEED = 0\nANSWER = (2 - 1) / 7\n")
    assert check_common.written_values(student) == {"SEED": 0, "ANSWER": 1 / 7}
    for code in ("ANSWER = len('abc')", "ANSWER = lambda v: 0.5", "def ANSWER(v):\n    return 0.5", "ANSWER = x"):
        student.write_text(f"SEED = 0\n{code}\n")
        assert NOT_CODE in checks.check("6.2", student)[0], code


def test_every_threshold_key_is_an_exact_computation():
    """Where a question asks for a threshold, its key is computed exactly (fractions or whole bytes),
    and agrees with the closed form: 1F1B's and GPipe's bubbles are (p - 1)/(m + p - 1) exactly, as
    fractions of the simulated timeline; the ring's α-β time is a fraction; 6.4's key is 28."""
    from fractions import Fraction

    import checks_answers_0_3

    from minipar.pipeline.schedules import build
    from minipar.pipeline.timeline import simulate
    for p, m in [(2, 6), (3, 10), (4, 27), (4, 28), (5, 6), (6, 16)]:
        for name in ("gpipe", "1f1b"):
            assert checks_answers_4_9.exact_idle(simulate(build(name, p, m))) == Fraction(p - 1, m + p - 1)
    assert checks_answers_4_9.truth_microbatches_for_bubble() == 28  # 3/30 is not under 1/10; 3/31 is
    for nbytes in (2**20, 64 * 2**20):
        n = checks_answers_0_3.truth_doubling_ranks(nbytes)
        t = checks_answers_0_3.all_reduce_seconds
        assert isinstance(t(nbytes, n), Fraction) and t(nbytes, n) >= 2 * t(nbytes, 2) > t(nbytes, n - 1)
    for v in checks_answers_4_9.CAUSAL_SPACE:  # last chunk's work over the first's: a ratio of whole numbers
        c = v["seq_len"] // v["cp"]
        work = Fraction(sum(range(v["seq_len"] - c + 1, v["seq_len"] + 1)), sum(range(1, c + 1)))
        assert checks_answers_4_9.truth_contiguous_imbalance(v["cp"], v["seq_len"]) == float(work)


def test_a_switch_off_leaves_the_library_as_it_was_even_after_a_reload():
    """After an answer that reloads the library's module (or takes it out of sys.modules), every
    function and class of the library is the one it was, and the checkers' modules are back."""
    import importlib
    import sys

    import minipar.context_parallel
    import minipar.pipeline.schedules
    before = (minipar.context_parallel.zigzag_positions, minipar.context_parallel.split_sequence,
              minipar.pipeline.schedules.gpipe, minipar.pipeline.schedules.Action)
    exec_module = importlib._bootstrap_external._LoaderBasics.exec_module
    for number, which in (("5.1", "wrong_reload"), ("5.1", "wrong_fresh_import"), ("6.1", "wrong_reload")):
        assert checks.check(number, answer(number, which)) != []
    assert (minipar.context_parallel.zigzag_positions, minipar.context_parallel.split_sequence,
            minipar.pipeline.schedules.gpipe, minipar.pipeline.schedules.Action) == before
    assert sys.modules["minipar.context_parallel"] is minipar.context_parallel
    assert importlib._bootstrap_external._LoaderBasics.exec_module is exec_module
    assert sys.modules["checks"] is checks and sys.modules["check_common"] is check_common


def test_a_library_module_first_imported_while_the_answer_is_off_gets_the_originals_back():
    """A student's `from minipar.tensor_parallel import all_reduce` (exercise 1.1's re-export) imports
    tensor_parallel for the first time while all_reduce is off: it binds the stand-in. After the check,
    every library module holds the original again; else a later check in the same worker (4.1's, on the
    test pool's ranks) met 1.1's refusal."""
    import types

    import minipar.collectives
    original, planted = minipar.collectives.all_reduce, types.ModuleType("minipar._planted")
    with check_common.switched_off(("minipar.collectives:all_reduce",)):
        planted.all_reduce = minipar.collectives.all_reduce  # what the import binds while the answer is off
        sys.modules["minipar._planted"] = planted
        assert planted.all_reduce is not original
    try:
        assert planted.all_reduce is original and minipar.collectives.all_reduce is original
    finally:
        del sys.modules["minipar._planted"]
