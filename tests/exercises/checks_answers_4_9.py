"""Checkers of the predict and explore exercises of chapters 4-9 (as checks_answers_0_3.py: ANSWER
against the library's own computation, recomputed here; each truth cached; each predict exercise a
variant the chapter does not print, drawn from a seed)."""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from check_common import Predict, answer_of, choice_problems, in_process, number_problems, numbers_problems
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
def truth_tp_weights(model: str, tp: int) -> float:
    from minipar.planning.estimate import held_bytes
    return held_bytes(*_cfg(model, tp=tp, seq_len=128))["params"] / MiB


# Chapter 4 works the small model at tp 2
TP_WEIGHTS_SPACE = [dict(model=m, tp=tp) for m in ("125m", "1b", "8b") for tp in (2, 4, 8) if (m, tp) != ("125m", 8)]

check_predict_tp_weights = Predict(
    TP_WEIGHTS_SPACE,
    lambda v: f"the {v['model']} model (minipar/model.py's CONFIGS) in float32 at tp = {v['tp']}: how many MiB of "
              f"weights does one rank hold?",
    lambda answer, v: number_problems(answer, truth_tp_weights(v["model"], v["tp"]), 0.02,
                                      f"the {v['model']} model's float32 weights on one rank at tp {v['tp']}, in MiB",
                                      "the estimator's held_bytes: what parallelize leaves on the rank"),
    lambda v: [f"{truth_tp_weights(v['model'], v['tp']):.2f} MiB",
               f"{truth_tp_weights(v['model'], v['tp']) * MiB:,.0f}"])


# -- Chapter 5 -----------------------------------------------------------------------------------

def causal_work(positions) -> int:
    """Attention's causal work for these query positions: token t attends to t + 1 keys."""
    return int((positions + 1).sum())


@lru_cache
def truth_contiguous_imbalance(cp: int = 4, seq_len: int = 1024) -> float:
    import torch
    chunks = torch.arange(seq_len).chunk(cp)  # the contiguous cut, rank r: chunk r
    return float(Fraction(causal_work(chunks[-1]), causal_work(chunks[0])))


# Chapter 5 draws cp 4 (and 1,024 tokens in the exercise as first written)
CAUSAL_SPACE = [dict(cp=cp, seq_len=n) for cp in (2, 3, 5, 6, 8) for n in (240, 960, 1920)]

check_predict_causal_work = Predict(
    CAUSAL_SPACE,
    lambda v: f"{v['seq_len']:,} tokens cut contiguously over cp = {v['cp']} ranks: how many times rank 0's causal "
              f"work does the last rank, {v['cp'] - 1}, do?",
    lambda answer, v: number_problems(answer, truth_contiguous_imbalance(v["cp"], v["seq_len"]), 0.02,
                                      f"the last rank's causal work over the first's, contiguous cut, cp {v['cp']}, "
                                      f"{v['seq_len']:,} tokens", "sum over a rank's tokens of t + 1"),
    lambda v: [f"{truth_contiguous_imbalance(v['cp'], v['seq_len']):.2f} x",
               f"{truth_contiguous_imbalance(v['cp'], v['seq_len']):.3f}"])


@lru_cache
def truth_cp_ratio() -> float:
    return _sent("small", "cp", cp=8) / _sent("small", "cp", cp=2)


@in_process
def check_explore_cp_bytes(student) -> list[str]:
    return number_problems(answer_of(student), truth_cp_ratio(), 0.02,
                           "what a rank sends on cp at cp 8, over what it sends at cp 2",
                           "run the file: python docs/exercises/ex5_3_explore_cp_bytes.py")


# -- Chapter 6 -----------------------------------------------------------------------------------

@lru_cache
def truth_bubble(p: int, m: int) -> float:
    from minipar.pipeline.schedules import build
    from minipar.pipeline.timeline import simulate
    return simulate(build("gpipe", p, m)).idle_fraction()


# Chapter 6 draws p 4, m 8, and prints many bubbles in percent: the (p, m) whose bubble it prints,
# even as another quantity, are left out
BUBBLE_SPACE = [dict(p=p, m=m) for p, m in ((2, 6), (2, 10), (3, 3), (3, 10), (3, 12), (5, 6), (5, 10), (6, 3),
                                            (6, 6), (6, 10), (6, 16), (4, 6))]

def bubble_problems(answer, v: dict) -> list[str]:
    """The idle fraction; an answer equal to the bubble ratio (p - 1)/m is told which one it is."""
    p, m = v["p"], v["m"]
    how = "run .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_06_pipeline.py, then think again"
    if not number_problems(answer, (p - 1) / m, 0.01, "", ""):
        how = f"{answer} is the bubble ratio (p - 1)/m, idle time over the work alone: the question asks over the " \
              "whole step, work and idle time together (chapter 6, \"The bubble\")"
    return number_problems(answer, truth_bubble(p, m), 0.01,
                           f"the idle fraction of the simulated GPipe timeline (p={p}, m={m}, F=1, B=2)", how)


check_predict_bubble = Predict(
    BUBBLE_SPACE,
    lambda v: f"GPipe on p = {v['p']} stages with m = {v['m']} micro-batches, a forward taking one unit of time and "
              f"a backward two: what fraction of the ranks' time is idle?",
    bubble_problems,
    lambda v: [f"{truth_bubble(v['p'], v['m']):.3f}", f"{100 * truth_bubble(v['p'], v['m']):.1f}%"])


@lru_cache
def truth_peak_activations(p: int, m: int, rank: int) -> tuple[int, int]:
    from minipar.pipeline.schedules import build, peak_activations
    return tuple(peak_activations(build(name, p, m).actions[rank]) for name in ("gpipe", "1f1b"))


# Chapter 6 draws rank 0 of p 4, m 8; the last rank (one micro-batch either way) is left out
# ((6, 3) and (10, 4) appear in docs/ as other things: those variants are left out too)
ACTIVATIONS_PP_SPACE = [dict(p=p, m=m, rank=r) for p in (3, 5, 6) for m in (2 * p, 3 * p + 1) for r in range(p - 1)
                        if (p, m, r) not in ((3, 6, 0), (5, 10, 1))]

check_predict_activations = Predict(
    ACTIVATIONS_PP_SPACE,
    lambda v: f"p = {v['p']} stages, m = {v['m']} micro-batches: at its worst moment, how many micro-batches' "
              f"activations does rank {v['rank']} hold under GPipe, and how many under 1F1B?",
    lambda answer, v: numbers_problems(answer, truth_peak_activations(v["p"], v["m"], v["rank"]), 0,
                                       ("under GPipe", "under 1F1B"),
                                       f"micro-batches whose activations rank {v['rank']} holds at its worst moment"),
    lambda v: [str(truth_peak_activations(v["p"], v["m"], v["rank"]))])


def exact_idle(timeline) -> Fraction:
    """A simulated timeline's idle fraction, exactly: unit costs (F 1, B 2) make every start and end a
    whole number, so busy time over ranks x makespan is a ratio of integers (the float 1 - busy/total
    rounds: 1 - 0.9 is 0.0999...98, and "under 10%" would take 3/30, exactly 10%)."""
    busy = sum(Fraction(end) - Fraction(start) for row in timeline.rows for start, end, _ in row)
    return 1 - busy / (len(timeline.rows) * Fraction(timeline.makespan))


@lru_cache
def truth_microbatches_for_bubble(p: int = 4, below: Fraction = Fraction(1, 10)) -> int:
    """The fewest m with 1F1B's simulated bubble strictly under `below` (exactly: 28 at p = 4)."""
    from minipar.pipeline.schedules import build
    from minipar.pipeline.timeline import simulate
    return next(m for m in range(1, 200) if exact_idle(simulate(build("1f1b", p, m))) < below)


@in_process
def check_explore_microbatches(student) -> list[str]:
    return number_problems(answer_of(student), truth_microbatches_for_bubble(), 0,
                           "the fewest micro-batches at which 1F1B's bubble at p=4 is under 10%",
                           "run the file: python docs/exercises/ex6_4_explore_microbatches.py")


# -- Chapter 7 -----------------------------------------------------------------------------------

@lru_cache
def truth_ep_sent(ep: int, seq_len: int) -> int:
    return _sent("small-moe", "ep", dp=ep, ep=ep, seq_len=seq_len)


# Chapter 7 works ep 4 at 256 tokens
EP_SPACE = [dict(ep=ep, seq_len=n) for ep in (4, 8) for n in (320, 448, 640, 896)]  # ep 2: round MiB, printed

check_predict_all_to_all = Predict(
    EP_SPACE,
    lambda v: f"the small-moe model (4 MoE blocks, dim 128, 8 experts, top-2) in float32 on {v['ep']} ranks with "
              f"ep = {v['ep']}, one sequence of {v['seq_len']} tokens per rank and step, uniform routing: how many "
              f"MiB does one rank send on the ep group per step?",
    lambda answer, v: number_problems(answer, truth_ep_sent(v["ep"], v["seq_len"]) / MiB, 0.02,
                                      f"what a rank sends on ep per step, in MiB (ep {v['ep']}, {v['seq_len']} "
                                      f"tokens)", "the estimator's bytes_sent (uniform routing) = the ledger's"),
    lambda v: [f"{truth_ep_sent(v['ep'], v['seq_len']):,}", f"{truth_ep_sent(v['ep'], v['seq_len']) / MiB:.2f} MiB"])


@lru_cache
def truth_ep_ratio() -> float:
    return _sent("small-moe", "ep", dp=8, ep=8) / _sent("small-moe", "ep", dp=2, ep=2)


@in_process
def check_explore_ep_bytes(student) -> list[str]:
    return number_problems(answer_of(student), truth_ep_ratio(), 0.02,
                           "what a rank sends on ep at ep 8, over what it sends at ep 2",
                           "run the file: python docs/exercises/ex7_3_explore_ep_bytes.py")


# -- Chapter 8 -----------------------------------------------------------------------------------

# Chapter 8 prints the planner's pick for 8b on 8 H100s at 8,192 tokens (B): the variants ask
# about other GPUs, sequence lengths and batches, where another letter wins.
PLAN_SPACE = [dict(gpus=g, seq_len=n, global_batch=b) for g, n in ((8, 2048), (8, 4096), (8, 16384), (16, 2048),
                                                                     (16, 16384)) for b in (256, 512, 2048)]


def plan_choices(gpus: int) -> dict[str, dict]:
    """The four layouts of `gpus` GPUs the exercise weighs (16 GPUs: twice the data parallelism)."""
    k = gpus // 8
    return {"A": dict(dp=8 * k, zero=3), "B": dict(dp=4 * k, cp=2, zero=3),
            "C": dict(dp=k, tp=8, sp=True, zero=1), "D": dict(dp=2 * k, pp=4, zero=1)}


def _flags(layout: dict) -> str:
    return " ".join(f"--{d} {n}" if n is not True else f"--{d}" for d, n in layout.items() if (d, n) != ("dp", 1))


@lru_cache
def truth_plan_choice(gpus: int, seq_len: int, global_batch: int) -> str:
    """The letter of the fastest layout that fits in 80 GB a GPU less the planner's 10% headroom: its own figures."""
    from minipar.planning.estimate import peak_bytes
    from minipar.planning.planner import Cluster, step_time
    figures = {}
    for letter, layout in plan_choices(gpus).items():
        c, cfg = _cfg("8b", seq_len=seq_len, global_batch=global_batch, dtype="bfloat16", **layout)
        figures[letter] = (peak_bytes(c, cfg) <= Cluster(gpus).usable, step_time(c, cfg, Cluster(gpus))["total"])
    return min((k for k, (fits, _) in figures.items() if fits), key=lambda k: figures[k][1])


def _plan_question(v: dict) -> str:
    letters = "   ".join(f"{k} {_flags(x)}" for k, x in plan_choices(v["gpus"]).items())
    return (f"Llama-3.1-8B on {v['gpus']} H100s (80 GB, 10% kept free, 8 a node), {v['global_batch']:,} sequences of "
            f"{v['seq_len']:,} tokens a step: of   {letters}   which does the planner rank fastest among those "
            f"that fit? (python scripts/tools/plan.py --model 8b --gpus {v['gpus']} --seq-len {v['seq_len']} "
            f"--global-batch {v['global_batch']} --top 60)")


check_explore_plan = Predict(
    PLAN_SPACE, _plan_question,
    lambda answer, v: choice_problems(answer, truth_plan_choice(**v),
                                      {k: _flags(x) for k, x in plan_choices(v["gpus"]).items()},
                                      "the planner ranks another first among the layouts that fit: run "
                                      f"python scripts/tools/plan.py --model 8b --gpus {v['gpus']} --seq-len "
                                      f"{v['seq_len']} --global-batch {v['global_batch']} --top 60"),
    lambda v: [])  # a letter: nothing the chapters could print gives it away


@lru_cache
def truth_compute_seconds(gpus: int, seq_len: int, global_batch: int) -> float:
    from minipar.planning.planner import Cluster, step_time
    c, cfg = _cfg("8b", dp=gpus, zero=3, seq_len=seq_len, global_batch=global_batch, dtype="bfloat16")
    return step_time(c, cfg, Cluster(gpus))["compute"]


# Chapter 8 works 8 GPUs, 1,024 sequences of 8,192 tokens
COMPUTE_SPACE = [dict(gpus=g, seq_len=n, global_batch=b) for g in (16, 32, 64) for n in (4096, 16384)
                 for b in (512, 2048)]

check_predict_compute_time = Predict(
    COMPUTE_SPACE,
    lambda v: f"Llama-3.1-8B (8.03 B parameters, 32 layers, dim 4,096) on {v['gpus']} H100s at 989 TFLOP/s and "
              f"45% MFU, one step of {v['global_batch']:,} sequences of {v['seq_len']:,} tokens: about how many "
              f"seconds of compute?",
    lambda answer, v: number_problems(answer, truth_compute_seconds(v["gpus"], v["seq_len"], v["global_batch"]),
                                      0.05, "the planner's compute seconds per step",
                                      "planner.step_time: FLOPs per token x tokens / (GPUs x peak x MFU)"),
    lambda v: [f"{truth_compute_seconds(v['gpus'], v['seq_len'], v['global_batch']):.1f} s",
               f"{truth_compute_seconds(v['gpus'], v['seq_len'], v['global_batch']):.2f} s"])


# -- Chapter 9 -----------------------------------------------------------------------------------

# Chapter 9 prints every rank's groups of the 16-rank dp 2 x tp 2 x pp 2 x cp 2 mesh: 32 ranks here
MESHES = (dict(dp=2, tp=4, pp=2, cp=2), dict(dp=4, tp=2, pp=2, cp=2), dict(dp=2, tp=2, pp=4, cp=2),
          dict(dp=2, tp=2, pp=2, cp=4))
DIMS = ("tp", "cp", "dp", "pp")


def mesh_groups(mesh: dict, rank: int) -> dict[str, list[int]]:
    from minipar.mesh import MeshLayout
    layout = MeshLayout(world_size=32, **mesh)
    return {d: next(g for g in layout.groups(d) if rank in g) for d in DIMS}


def _mesh_words(mesh: dict) -> str:
    return " x ".join(f"{d} {mesh[d]}" for d in ("dp", "tp", "pp", "cp"))


MESH_SPACE = [dict(mesh=m, rank=r) for m in MESHES for r in range(32)]


def _mesh_problems(answer, v) -> list[str]:
    truth = mesh_groups(v["mesh"], v["rank"])
    if not isinstance(answer, dict) or set(answer) != set(truth):
        return [f"ANSWER = {answer!r}: write a dict with the keys 'tp', 'cp', 'dp', 'pp'"]
    wrong = [f"{d}: {sorted(answer[d])} is not it" for d in truth if sorted(answer[d]) != truth[d]]
    return [f"rank {v['rank']}'s groups: " + "; ".join(wrong) + " (mesh.py: tp varies fastest, then cp, dp, pp)"] \
        if wrong else []


check_predict_mesh_groups = Predict(
    MESH_SPACE,
    lambda v: f"32 ranks as {_mesh_words(v['mesh'])}, tp varying fastest, then cp, dp, pp: which ranks share each "
              f"kind of group with rank {v['rank']}?",
    _mesh_problems,
    lambda v: ["  ".join(f"{d} {g}" for d, g in mesh_groups(v["mesh"], v["rank"]).items())])


def cross_node_dims(mesh: dict, ranks_per_node: int) -> list[str]:
    from minipar.mesh import MeshLayout
    layout = MeshLayout(world_size=32, **mesh, ranks_per_node=ranks_per_node)
    return sorted(d for d in DIMS if any(len({layout.node(r) for r in g}) > 1 for g in layout.groups(d)))


def _cross_node_problems(answer, v) -> list[str]:
    if isinstance(answer, (list, tuple, set)) and sorted(answer) == cross_node_dims(v["mesh"], v["ranks_per_node"]):
        return []
    return [f"ANSWER = {answer!r}: not the dimensions whose groups span two nodes (mesh.py: tp varies fastest, then "
            f"cp, dp, pp; ranks 0-{v['ranks_per_node'] - 1} are node 0)"]


CROSS_SPACE = [dict(mesh=m, ranks_per_node=n) for m in MESHES for n in (4, 8, 16)]

check_predict_cross_node = Predict(
    CROSS_SPACE,
    lambda v: f"32 ranks as {_mesh_words(v['mesh'])} (tp varying fastest, then cp, dp, pp) on nodes of "
              f"{v['ranks_per_node']} GPUs (ranks 0-{v['ranks_per_node'] - 1} on node 0): which kinds of group have "
              f"members on two nodes?",
    _cross_node_problems,
    lambda v: [str(cross_node_dims(v["mesh"], v["ranks_per_node"]))])


LAYOUTS_16 = {"A": dict(dp=16), "B": dict(dp=16, zero=3), "C": dict(dp=8, tp=2, sp=True),
              "D": dict(dp=4, tp=2, pp=2, sp=True), "E": dict(dp=2, tp=2, pp=2, cp=2, sp=True, zero=1),
              "F": dict(dp=1, tp=4, pp=2, cp=2, sp=True)}


@lru_cache
def layout_16_figures(seq_len: int) -> dict[str, tuple[int, int]]:
    """{letter: (the fullest rank's bytes, the bytes the busiest rank sends per step)}: the estimator's."""
    from minipar.planning.estimate import peak_bytes
    from minipar.planning.traffic import bytes_sent
    figures = {}
    for k, layout in LAYOUTS_16.items():
        c, cfg = _cfg("small", model_vocab=256, seq_len=seq_len, global_batch=16, dtype="float64", **layout)
        figures[k] = peak_bytes(c, cfg), max(sum(bytes_sent(c, cfg, r).values()) for r in range(cfg.pp))
    return figures


def truth_cheapest_within(seq_len: int, budget_mib: float) -> str:
    fits = {k: sent for k, (held, sent) in layout_16_figures(seq_len).items() if held <= budget_mib * 2**20}
    return min(fits, key=fits.get)


# Chapter 9 asks which layout holds the least (F, at every length): the variants ask which sends the
# least among those within a memory budget, where F is never the answer (E or D).
BUDGET_SPACE = [dict(seq_len=s, budget_mib=m) for s, budgets in ((32, (6, 8, 10, 20)), (64, (7, 10, 12, 25)),
                                                                 (128, (9, 12, 15, 30))) for m in budgets]

check_explore_16_ranks = Predict(
    BUDGET_SPACE,
    lambda v: f"of the six layouts of 16 ranks at --seq-len {v['seq_len']}, those whose fullest rank holds at most "
              f"{v['budget_mib']} MiB: which one's busiest rank sends the fewest bytes per step? (run the file: "
              "python docs/exercises/ex9_2_explore_16_ranks.py)",
    lambda answer, v: choice_problems(answer, truth_cheapest_within(**v), {k: " ".join(
        f"--{d} {n}" if n is not True else f"--{d}" for d, n in x.items()) for k, x in LAYOUTS_16.items()},
        f"the cheapest within {v['budget_mib']} MiB: read the file's table at --seq-len {v['seq_len']}"),
    lambda v: [])  # a letter: nothing the chapters could print gives it away
