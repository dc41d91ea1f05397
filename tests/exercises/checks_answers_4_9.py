"""Checkers of the predict and explore exercises of chapters 4-9 (as checks_answers_0_3.py: ANSWER
against the library's own computation, recomputed here; each truth cached)."""

from __future__ import annotations

from functools import lru_cache

from check_common import answer_of, choice_problems, in_process, number_problems, numbers_problems
from checks_answers_0_3 import MiB, _cfg, _sent

# -- Chapter 4 -----------------------------------------------------------------------------------


@lru_cache
def truth_tp_ratio() -> float:
    return _sent("small", "tp", tp=4) / _sent("small", "tp", tp=2)


@in_process
def check_explore_tp_bytes(student) -> list[str]:
    return number_problems(answer_of(student), truth_tp_ratio(), 0.02,
                           "what a rank sends on tp at tp 4, over what it sends at tp 2",
                           "run the file: python docs/exercises/ex4_2_explore_tp_bytes.py")


@lru_cache
def truth_tp_weights() -> float:
    from minipar.planning.estimate import held_bytes
    return held_bytes(*_cfg("small", tp=2))["params"] / MiB


@in_process
def check_predict_tp_weights(student) -> list[str]:
    return number_problems(answer_of(student), truth_tp_weights(), 0.02,
                           "the small model's float32 weights on one rank at tp 2, in MiB",
                           "the estimator's held_bytes: what parallelize leaves on the rank")


# -- Chapter 5 -----------------------------------------------------------------------------------

def causal_work(positions) -> int:
    """Attention's causal work for these query positions: token t attends to t + 1 keys."""
    return int((positions + 1).sum())


@lru_cache
def truth_contiguous_imbalance(cp: int = 4, seq_len: int = 1024) -> float:
    import torch
    chunks = torch.arange(seq_len).chunk(cp)  # the contiguous cut, rank r: chunk r
    return causal_work(chunks[-1]) / causal_work(chunks[0])


@in_process
def check_predict_causal_work(student) -> list[str]:
    return number_problems(answer_of(student), truth_contiguous_imbalance(), 0.02,
                           "the last rank's causal work over the first's, contiguous cut, cp 4, 1,024 tokens",
                           "sum over a rank's tokens of t + 1")


@lru_cache
def truth_cp_ratio() -> float:
    return _sent("small", "cp", cp=8) / _sent("small", "cp", cp=2)


@in_process
def check_explore_cp_bytes(student) -> list[str]:
    return number_problems(answer_of(student), truth_cp_ratio(), 0.02,
                           "what a rank sends on cp at cp 8, over what it sends at cp 2",
                           "run the file: python docs/exercises/ex5_3_explore_cp_bytes.py")


# -- Chapter 6 -----------------------------------------------------------------------------------

@in_process
def check_predict_bubble(student) -> list[str]:
    from minipar.pipeline.schedules import build
    from minipar.pipeline.timeline import simulate
    return number_problems(answer_of(student), simulate(build("gpipe", 4, 8)).idle_fraction(), 0.01,
                           "the idle fraction of the simulated GPipe timeline (p=4, m=8, F=1, B=2)",
                           "run scripts/step_06_pipeline.py, then think again")


@in_process
def check_predict_activations(student) -> list[str]:
    from minipar.pipeline.schedules import build, peak_activations
    truths = tuple(peak_activations(build(name, 4, 8).actions[0]) for name in ("gpipe", "1f1b"))
    return numbers_problems(answer_of(student), truths, 0, ("under GPipe", "under 1F1B"),
                            "micro-batches whose activations rank 0 holds at its worst moment")


@lru_cache
def truth_microbatches_for_bubble(p: int = 4, below: float = 0.10) -> int:
    from minipar.planning.planner import pipeline_idle
    return next(m for m in range(1, 200) if pipeline_idle("1f1b", p, m) < below)


@in_process
def check_explore_microbatches(student) -> list[str]:
    return number_problems(answer_of(student), truth_microbatches_for_bubble(), 0,
                           "the fewest micro-batches at which 1F1B's bubble at p=4 is under 10%",
                           "run the file: python docs/exercises/ex6_4_explore_microbatches.py")


# -- Chapter 7 -----------------------------------------------------------------------------------

@lru_cache
def truth_ep_sent() -> float:
    return _sent("small-moe", "ep", dp=4, ep=4) / MiB


@in_process
def check_predict_all_to_all(student) -> list[str]:
    return number_problems(answer_of(student), truth_ep_sent(), 0.02,
                           "what a rank sends on ep per step, in MiB",
                           "the estimator's bytes_sent (uniform routing), equal to the ledger's")


@lru_cache
def truth_ep_ratio() -> float:
    return _sent("small-moe", "ep", dp=8, ep=8) / _sent("small-moe", "ep", dp=2, ep=2)


@in_process
def check_explore_ep_bytes(student) -> list[str]:
    return number_problems(answer_of(student), truth_ep_ratio(), 0.02,
                           "what a rank sends on ep at ep 8, over what it sends at ep 2",
                           "run the file: python docs/exercises/ex7_3_explore_ep_bytes.py")


# -- Chapter 8 -----------------------------------------------------------------------------------

PLAN_CHOICES = {"A": dict(dp=8, zero=3), "B": dict(dp=4, cp=2, zero=3), "C": dict(tp=8, sp=True, zero=1),
                "D": dict(dp=2, pp=4, zero=1)}


def planned(layout: dict) -> tuple[bool, float]:
    """(fits in 80 GB, seconds per step) of 8b on 8 H100s, seq 8192, 1024 sequences: the planner's figures."""
    from minipar.planning.estimate import peak_bytes
    from minipar.planning.planner import Cluster, step_time
    c, cfg = _cfg("8b", seq_len=8192, global_batch=1024, dtype="bfloat16", **layout)
    return peak_bytes(c, cfg) <= Cluster(8).memory, step_time(c, cfg, Cluster(8))["total"]


@lru_cache
def truth_plan_choice() -> str:
    figures = {k: planned(v) for k, v in PLAN_CHOICES.items()}
    return min((k for k, (fits, _) in figures.items() if fits), key=lambda k: figures[k][1])


@in_process
def check_explore_plan(student) -> list[str]:
    flags = {k: " ".join(f"--{d} {n}" if n is not True else f"--{d}" for d, n in v.items())
             for k, v in PLAN_CHOICES.items()}
    return choice_problems(answer_of(student), truth_plan_choice(), flags,
                           "run: python scripts/plan.py --model 8b --gpus 8 --seq-len 8192 --global-batch 1024 "
                           "--top 40")


@lru_cache
def truth_compute_seconds() -> float:
    from minipar.planning.planner import Cluster, step_time
    c, cfg = _cfg("8b", dp=8, zero=3, seq_len=8192, global_batch=1024, dtype="bfloat16")
    return step_time(c, cfg, Cluster(8))["compute"]


@in_process
def check_predict_compute_time(student) -> list[str]:
    return number_problems(answer_of(student), truth_compute_seconds(), 0.05,
                           "the planner's compute seconds per step",
                           "planner.step_time: FLOPs per token x tokens / (GPUs x peak x MFU)")


# -- Chapter 9 -----------------------------------------------------------------------------------

MESH_4D = dict(world_size=16, dp=2, tp=2, pp=2, cp=2)


@in_process
def check_predict_mesh_groups(student) -> list[str]:
    from minipar.mesh import MeshLayout
    layout, answer = MeshLayout(**MESH_4D), answer_of(student)
    truth = {d: next(g for g in layout.groups(d) if 5 in g) for d in ("tp", "cp", "dp", "pp")}
    if not isinstance(answer, dict) or set(answer) != set(truth):
        return [f"ANSWER = {answer!r}: write a dict with the keys 'tp', 'cp', 'dp', 'pp'"]
    wrong = [f"{d}: {sorted(answer[d])} is not it" for d in truth if sorted(answer[d]) != truth[d]]
    return ["rank 5's groups: " + "; ".join(wrong) + " (mesh.py: tp varies fastest, then cp, dp, pp)"] if wrong else []


LAYOUTS_16 = {"A": dict(dp=16), "B": dict(dp=16, zero=3), "C": dict(dp=8, tp=2, sp=True),
              "D": dict(dp=4, tp=2, pp=2, sp=True), "E": dict(dp=2, tp=2, pp=2, cp=2, sp=True, zero=1),
              "F": dict(dp=1, tp=4, pp=2, cp=2, sp=True)}


@lru_cache
def truth_smallest_layout() -> str:
    from minipar.planning.estimate import peak_bytes
    fullest = {k: peak_bytes(*_cfg("small", model_vocab=256, seq_len=32, global_batch=16, dtype="float64", **v))
               for k, v in LAYOUTS_16.items()}
    return min(fullest, key=fullest.get)


@in_process
def check_explore_16_ranks(student) -> list[str]:
    flags = {k: " ".join(f"--{d} {n}" if n is not True else f"--{d}" for d, n in v.items())
             for k, v in LAYOUTS_16.items()}
    return choice_problems(answer_of(student), truth_smallest_layout(), flags,
                           "run the file: python docs/exercises/ex9_2_explore_16_ranks.py")


@in_process
def check_predict_cross_node(student) -> list[str]:
    from minipar.mesh import MeshLayout
    layout = MeshLayout(**MESH_4D, ranks_per_node=8)
    truth = sorted(d for d in ("tp", "cp", "dp", "pp") if any(len({layout.node(r) for r in g}) > 1
                                                              for g in layout.groups(d)))
    answer = answer_of(student)
    if not isinstance(answer, (list, tuple, set)) or sorted(answer) != truth:
        return [f"ANSWER = {answer!r}: not the dimensions whose groups span two nodes (mesh.py: tp varies "
                f"fastest, then cp, dp, pp; ranks 0-7 are node 0)"]
    return []
