"""What every exercise checker shares: loading a student's file, turning a skeleton's
NotImplementedError (or an `ANSWER = None`) into one line, running a check on gloo ranks without
letting a wrong answer kill the pool, and comparing an answer with the library's own figure.

A checker never raises for a wrong answer: it returns the problems, as lines a student can act on.
"""

from __future__ import annotations

import importlib.util
from fractions import Fraction
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
EXERCISES_DIR = ROOT / "docs" / "exercises"


class NotImplementedYet(Exception):
    pass


def load(path) -> object:
    """The student's file as a fresh module (re-read on every call: the student edits it)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attempt(fn, *args):
    """Call the student's fn; a NotImplementedError becomes NotImplementedYet with its hint."""
    try:
        return fn(*args)
    except NotImplementedError as e:
        raise NotImplementedYet(f"{fn.__name__}: not implemented yet ({e})") from None


def max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)}, expected {tuple(b.shape)}"
    return f"max abs diff {(a.double() - b.double()).abs().max().item():.3g}"


def guarded(rank_fn):
    """Run one rank's check; report a skeleton or a crash as a line, not a traceback."""
    def run(rank, world, path, *args):
        try:
            return rank_fn(rank, world, load(path), *args)
        except NotImplementedYet as e:
            return {"problems": [str(e)]}
        except Exception as e:  # noqa: BLE001 - the student's error, reported on one line
            return {"problems": [f"rank {rank}: raised {type(e).__name__}: {e}"]}
    run.__name__ = run.__qualname__ = rank_fn.__name__ + "_guarded"
    run.__module__ = rank_fn.__module__  # the workers find it by module and name: assign it there
    return run


def collect(results: list[dict]) -> list[str]:
    """Every rank's problems, each line once (a skeleton fails the same way on every rank)."""
    return list(dict.fromkeys(p for r in results for p in r["problems"]))


def on_ranks(rank_fn_guarded, path, run_ranks, worlds=(2, 4), *args) -> list[str]:
    """The problems of the first world size (of `worlds`) at which some rank found one."""
    for world in worlds:
        problems = collect(run_ranks(world, rank_fn_guarded, str(path), *args))
        if problems:
            return problems
    return []


def world_group(name: str):
    import torch.distributed as dist

    from minipar.collectives import Group, Ledger
    return Group(name, dist.group.WORLD, list(range(dist.get_world_size())), Ledger())


def in_process(check_fn):
    """A checker that needs no ranks: the student's module in, problems out; a skeleton is one line."""
    def checker(path, run_ranks=None) -> list[str]:
        try:
            return check_fn(load(path))
        except NotImplementedYet as e:
            return [str(e)]
    checker.__name__ = check_fn.__name__
    return checker


# -- Predict and explore: the student writes ANSWER; the key is the library's own computation ----

def answer_of(student):
    answer = student.ANSWER
    if answer is None:
        raise NotImplementedYet("ANSWER: not answered yet (write your answer in the file)")
    return answer


def as_number(x) -> float | None:
    """x as a float (a fraction like "3/7" too), or None when it is not a number."""
    try:
        return float(Fraction(x) if isinstance(x, str) else x)
    except (TypeError, ValueError, ZeroDivisionError):
        return None


def _off(value: float | None, truth: float, rel: float) -> str:
    """'' when value is within rel of truth; else which way it is off."""
    if value is None:
        return "not a number"
    if abs(value - truth) <= rel * abs(truth):
        return ""
    return "the library's is more" if truth > value else "the library's is less"


def number_problems(answer, truth: float, rel: float, what: str, how: str) -> list[str]:
    """[] when answer is within `rel` of truth, else one line saying which way it is off."""
    off = _off(as_number(answer), truth, rel)
    return [f"ANSWER = {answer!r}: not {what}: {off} ({how})"] if off else []


def numbers_problems(answer, truths: tuple, rel: float, names: tuple, how: str) -> list[str]:
    """The same for a tuple of numbers, naming each one that is off."""
    if not isinstance(answer, (tuple, list)) or len(answer) != len(truths):
        return [f"ANSWER = {answer!r}: write {len(truths)} numbers, ({', '.join(names)})"]
    wrong = [f"{name}: {a!r} is not it, {off}" for name, a, t in zip(names, answer, truths)
             if (off := _off(as_number(a), t, rel))]
    return [f"ANSWER = {tuple(answer)!r}: " + "; ".join(wrong) + f" ({how})"] if wrong else []


def choice_problems(answer, truth, choices: dict, how: str) -> list[str]:
    """A multiple choice: answer must be the key of `choices` (case-insensitive) that is true."""
    key = str(answer).strip().upper()
    if key not in choices:
        return [f"ANSWER = {answer!r}: write one of {', '.join(map(repr, choices))}"]
    return [] if key == truth else [f"ANSWER = {answer!r}: not {choices[key]} ({how})"]
