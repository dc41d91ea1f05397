"""Checkers of the predict and explore exercises of chapters 0-3 (4-9: checks_answers_4_9.py): the
student writes ANSWER (a number, a few numbers, or a choice); the key is the library's own
computation (the estimator, the schedules' simulation, the mesh, the ledger's byte formulas),
recomputed here, never a number copied in. Each `truth_*` is cached: a test asks for it twice.

A predict exercise asks about a variant the chapter does not print, drawn from a seed
(check_common.Predict): `make exercise` prints the student's; each `*_SPACE` lists them all.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

from check_common import Predict, answer_of, in_process, number_problems, numbers_problems

MiB = 2**20


def _cfg(model: str, model_vocab: int | None = None, **kw):
    """(model config, train config) validated for its world; model_vocab: a smaller vocabulary for the
    model alone, as scripts/course/step_09_4d.py uses."""
    from minipar.model import get_config
    from minipar.run.config import TrainConfig
    c = get_config(model, vocab_size=model_vocab) if model_vocab else get_config(model)
    world = kw.get("dp", 1) * kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)
    kw = {"seq_len": 256, "micro_batch": 1, "global_batch": kw.get("dp", 1),
          **({} if "precision" in kw else {"dtype": "float32"}), **kw}
    cfg = TrainConfig(model=model, **({} if model_vocab else {"vocab_size": c.vocab_size}), **kw)
    cfg.validate(world)
    return c, cfg


def _sent(model: str, group: str, **kw) -> int:
    """Bytes pp rank 0 sends per step on `group` (every op), by the estimator (= the ledger)."""
    from minipar.planning.traffic import bytes_sent
    return sum(v for k, v in bytes_sent(*_cfg(model, **kw)).items() if k.split("/")[0] == group)


# -- Chapter 0 -----------------------------------------------------------------------------------

@lru_cache
def truth_activations_small(micro_batch: int, seq_len: int) -> float:
    from minipar.planning.estimate import activation_bytes
    return activation_bytes(*_cfg("small", seq_len=seq_len, micro_batch=micro_batch,
                                  global_batch=micro_batch)) / MiB


# Chapter 0 prints 4 x 128 (30.93 MiB); 2 x 64's figure appears in docs/ as another quantity
ACTIVATIONS_SPACE = [dict(b=b, s=s) for b in (2, 3, 6, 8, 16) for s in (64, 192, 256, 512, 768) if (b, s) != (2, 64)]


def _activations_problems(answer, v) -> list[str]:
    return number_problems(answer, truth_activations_small(v["b"], v["s"]), 0.03,
                           f"the small model's activations at {v['b']} x {v['s']} tokens, in MiB",
                           "the estimator's activation_bytes; chapter 0 shows 4 x 128")


check_predict_small_activations = Predict(
    ACTIVATIONS_SPACE,
    lambda v: f"the small model in float32 at a micro-batch of {v['b']} x {v['s']} tokens: how many MiB of "
              f"activations?",
    _activations_problems,
    lambda v: [f"{truth_activations_small(v['b'], v['s']):.2f} MiB",
               f"{truth_activations_small(v['b'], v['s']):.1f} MiB"])


SEQ_LENS = (64, 128, 256, 512, 1024, 2048)


def small_model_bytes(seq_len: int) -> tuple[int, int]:
    """(activations, model states) of the small model, float32, one sequence of seq_len."""
    from minipar.planning.estimate import activation_bytes, held_bytes
    c, cfg = _cfg("small", seq_len=seq_len)
    return activation_bytes(c, cfg), sum(held_bytes(c, cfg).values())


@lru_cache
def truth_crossover_seq_len() -> int:
    return next(s for s in SEQ_LENS if small_model_bytes(s)[0] > small_model_bytes(s)[1])


@in_process
def check_explore_seq_len(student) -> list[str]:
    return number_problems(answer_of(student), truth_crossover_seq_len(), 0,
                           f"the first of {SEQ_LENS} at which activations outgrow the model states",
                           "run the file: python docs/exercises/ex0_3_explore_seq_len.py")


# -- Chapter 1 -----------------------------------------------------------------------------------

def truth_ring_bytes(elements: int, n: int) -> tuple[int, ...]:
    from minipar.collectives import ring_bytes_sent
    return tuple(ring_bytes_sent(op, elements * 4, n) for op in ("all_reduce", "reduce_scatter", "all_gather"))


# Chapter 1 works N = 4 and 4 MiB
# (element counts that 3, 5, 6 and 8 divide, so that every answer is a whole number of bytes)
RING_SPACE = [dict(n=n, elements=e) for n in (3, 5, 6, 8) for e in (360_000, 1_200_000, 2_520_000, 6_000_000)]

check_predict_ring_bytes = Predict(
    RING_SPACE,
    lambda v: f"{v['n']} ranks each hold a float32 tensor of {v['elements']:,} elements: how many bytes does one "
              f"rank send, by the ring, in an all-reduce of it, a reduce-scatter of it, an all-gather whose result "
              f"it is?",
    lambda answer, v: numbers_problems(answer, truth_ring_bytes(v["elements"], v["n"]), 0,
                                       ("all_reduce", "reduce_scatter", "all_gather"),
                                       "bytes one rank sends by the ring, collectives.ring_bytes_sent"),
    lambda v: [f"{b:,}" for b in truth_ring_bytes(v["elements"], v["n"])])


ALPHA, BETA = 80e-6, 0.55e-9  # chapter 1's fit on gloo, rounded: s per ring step, s per byte


def all_reduce_seconds(nbytes: int, n: int) -> Fraction:
    """The ring all-reduce under the α-β model: 2(N-1) steps, each an α, plus β per byte sent; exact
    (the rounded α and β as the decimals they are written as), so that "doubles" is no float's luck."""
    from minipar.collectives import ring_bytes_sent
    alpha, beta = Fraction(str(ALPHA)), Fraction(str(BETA))
    return alpha * 2 * (n - 1) + beta * ring_bytes_sent("all_reduce", nbytes, n)


def truth_doubling_ranks(nbytes: int) -> int:
    return next(n for n in range(3, 65) if all_reduce_seconds(nbytes, n) >= 2 * all_reduce_seconds(nbytes, 2))


@in_process
def check_explore_alpha_beta(student) -> list[str]:
    return numbers_problems(answer_of(student), (truth_doubling_ranks(MiB), truth_doubling_ranks(64 * MiB)), 0,
                            ("N for 1 MiB", "N for 64 MiB"),
                            "run the file: python docs/exercises/ex1_3_explore_alpha_beta.py")


# -- Chapter 2 -----------------------------------------------------------------------------------

BUCKET_MBS = (0.25, 1, 25)


def small_model_buckets(bucket_mb: float) -> list[int]:
    """The bytes of each all-reduce DataParallel sends per step for the small model (float32)."""
    from minipar.data_parallel import bucket_params
    from minipar.model import Llama, get_config
    params = list(reversed(list(Llama(get_config("small"), seed=0).parameters())))
    return [sum(p.numel() * p.element_size() for p in b) for b in bucket_params(params, bucket_mb)]


@lru_cache
def truth_bucket_counts() -> tuple[int, ...]:
    return tuple(len(small_model_buckets(mb)) for mb in BUCKET_MBS)


@in_process
def check_explore_bucket_size(student) -> list[str]:
    return numbers_problems(answer_of(student), truth_bucket_counts(), 0,
                            tuple(f"all-reduces at --bucket-mb {mb}" for mb in BUCKET_MBS),
                            "run the file: python docs/exercises/ex2_3_explore_bucket_size.py")


# -- Chapter 3 -----------------------------------------------------------------------------------

@lru_cache
def truth_zero3_sent(model: str, dp: int) -> int:
    """Bytes one rank sends on dp per step under ZeRO-3 (float32, one micro-batch of 64 tokens)."""
    return _sent(model, "dp", dp=dp, zero=3, seq_len=64)


# Chapter 3 prints the small model at dp 4 (16,525,446 bytes)
# (and a training log at dp 2); 14.01 MiB, dp 3's, appears as another quantity
ZERO3_SPACE = [dict(model=m, dp=dp) for m in ("small", "125m") for dp in (2, 3, 5, 6, 8)
               if (m, dp) not in (("small", 2), ("small", 3))]

check_predict_zero3_bytes = Predict(
    ZERO3_SPACE,
    lambda v: f"the {v['model']} model in float32, data-parallel over {v['dp']} ranks with ZeRO-3, one micro-batch "
              f"per step: how many MiB does one rank send on the dp group per step?",
    lambda answer, v: number_problems(answer, truth_zero3_sent(v["model"], v["dp"]) / MiB, 0.02,
                                      f"what a rank sends on dp per step under ZeRO-3, in MiB (the {v['model']} "
                                      f"model, dp {v['dp']})", "the estimator's bytes_sent, equal to the ledger's"),
    lambda v: [f"{truth_zero3_sent(v['model'], v['dp']):,}", f"{truth_zero3_sent(v['model'], v['dp']) / MiB:.2f} MiB"])


DPS = (1, 2, 4, 8, 16, 32)


def zero3_8b_peak(dp: int) -> int:
    from minipar.planning.estimate import peak_bytes
    return peak_bytes(*_cfg("8b", dp=dp, zero=3, seq_len=4096, precision="bf16-mixed"))


@lru_cache
def truth_zero3_dp() -> int:
    return next(dp for dp in DPS if zero3_8b_peak(dp) <= 80e9)


@in_process
def check_explore_zero3_dp(student) -> list[str]:
    return number_problems(answer_of(student), truth_zero3_dp(), 0,
                           f"the smallest dp of {DPS} at which ZeRO-3 fits 8b in 80 GB",
                           "run the file: python docs/exercises/ex3_3_explore_zero3_dp.py")
