"""What every exercise checker shares: loading a student's file, turning a skeleton's
NotImplementedError (or an `ANSWER = None`) into one line, running a check on gloo ranks without
letting a wrong answer kill the pool, switching off the library's own answer while the student's
code runs (by every route: see switched_off), reading a prediction as a value written out (never
running it) with a few tries per variant, and comparing an answer with the library's figure.

A checker never raises for a wrong answer: it returns the problems, as lines a student can act on.
"""

from __future__ import annotations

import ast
import contextlib
import getpass
import hashlib
import importlib
import importlib.util
import json
import operator
import os
import random
import sys
import sysconfig
import zlib
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
EXERCISES_DIR = ROOT / "docs" / "exercises"


class NotImplementedYet(Exception):
    pass


def load(path) -> object:
    """The student's file as a fresh module (re-read on every call: the student edits it)."""
    if _RUN is not None and not _RUN["student"]:  # loaded under switched_off: the file is the student's
        _RUN["student"] = os.path.abspath(path)
        _RUN["cached"] = importlib.util.cache_from_source(_RUN["student"])
    spec = importlib.util.spec_from_file_location(f"exercise_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ATTEMPTING = [0]  # > 0 while the checker calls one of the student's functions


def attempt(fn, *args):
    """Call the student's fn; a NotImplementedError becomes NotImplementedYet with its hint."""
    try:
        with students_code():
            return fn(*args)
    except NotImplementedError as e:
        raise NotImplementedYet(f"{getattr(fn, '__name__', fn)}: not implemented yet ({e})") from None


@contextlib.contextmanager
def students_code():
    """While the checker runs what the student's function installed (a layer's forward it replaced,
    a policy torch calls back): the library's switched-off answer refuses there as in the student's
    own call, though no line of the student's file is on the call stack when torch calls it."""
    _ATTEMPTING[0] += 1
    try:
        yield
    finally:
        _ATTEMPTING[0] -= 1


def max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)}, expected {tuple(b.shape)}"
    return f"max abs diff {(a.double() - b.double()).abs().max().item():.3g}"


# -- The library's answer, off by every route --------------------------------------------------
#
# While a student's file is loaded and run, each function of `names` (the library's own answer, and
# the siblings that compute it) refuses wherever it is reached: in every module that holds it (a
# re-export such as minipar.zero.bucket_params is the same object), in a module executed again
# (importlib.reload, a fresh import after `del sys.modules[...]`, exec_module of the library's file),
# and nothing the answer runs may open the library's sources outside the import system, any file
# under tests/ (the checkers' keys, the reference answers), or start a process. A call refuses when
# the student's code is on the call stack (the student's file, or code compiled from a string); the
# checker's own calls, with no student frame under them, reach the original.

_RUN: dict | None = None  # the student's run in progress: {"student": str, "off": {module: {path: why}}}
_TESTS, _ANSWERS, _LIBRARY = str(ROOT / "tests") + os.sep, str(ROOT / "tests" / "exercises" / "answers") + os.sep, \
    str(ROOT / "minipar") + os.sep
_TRUSTED = tuple({str(ROOT / "minipar") + os.sep, _TESTS, str(Path(torch.__file__).parents[1]) + os.sep,
                  *(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib"))})
_CHECKER_MODULES = ("check_common", "checks", "harness", "run", "conftest", "test_exercises")


def _student_on_stack() -> bool:
    """Whether a frame of the student's code (its file, or anything not of the library, the checkers,
    torch or the standard library: code compiled from a string too) is on the call stack."""
    if _ATTEMPTING[0]:  # the checker called the student's function, which may be the library's itself
        return True
    frame = sys._getframe(2)
    while frame is not None and frame is not _RUN["base"]:  # below the checker's own entry: not the student
        name = frame.f_code.co_filename
        if (name == _RUN["student"] or name.startswith(_ANSWERS)
                or not (name.startswith(_TRUSTED) or name.startswith("<frozen"))):
            return True
        frame = frame.f_back
    return False


_REFUSERS: dict[int, tuple] = {}  # id of each refusing stand-in: (it, the original it stands in for)


def _refusing(original, name: str, why: str):
    def refuse(*args, **kwargs):
        if _RUN is None or not _student_on_stack():
            return original(*args, **kwargs)  # the checker's own call
        raise RuntimeError(f"{name} is off in this exercise: {why}")
    refuse.__name__ = getattr(original, "__name__", name)
    _REFUSERS[id(refuse)] = (refuse, original)
    return refuse


def _module_name_of(module) -> str | None:
    """The dotted name of the library module a module object was executed from (by its file)."""
    file = getattr(module, "__file__", None)
    if not file or not os.path.abspath(file).startswith(_LIBRARY):
        return None
    rel = Path(os.path.abspath(file)).relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _switch_off_in(module, saved: list) -> None:
    """Switch off, by name, what `module` (a library module just executed) defines of the answer."""
    for path, why in _RUN["off"].get(_module_name_of(module) or "", {}).items():
        *owners, attr = path.split(".")
        holder = module
        for owner in owners:
            holder = getattr(holder, owner)
        original = getattr(holder, attr)
        if id(original) not in _REFUSERS:
            saved.append((holder, attr, original))
            setattr(holder, attr, _refusing(original, f"{_module_name_of(module)}.{path}", why))


_LOADING = [0]  # > 0 while the import system executes a library module (it may open its source)


def _audit(event: str, args) -> None:
    if _RUN is None:
        return
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn"):
        raise RuntimeError("starting a process is off in this exercise: write the answer in your file")
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path in (_RUN["student"], _RUN["cached"]) or any(f.f_code.co_filename.endswith(_SHOWING) for f in _frames()):
            return  # a warning or a traceback showing a line of the file
        if path.startswith(_TESTS):
            raise RuntimeError(f"reading {os.path.relpath(path, ROOT)} is off in this exercise: the checkers and "
                               f"the reference answers are not yours to read or run")
        if path.startswith(_LIBRARY) and not _LOADING[0]:
            raise RuntimeError(f"reading {os.path.relpath(path, ROOT)} is off in this exercise: import the "
                               f"library, do not execute its source again")


_SHOWING = (os.sep + "warnings.py", os.sep + "traceback.py")


def _frames():
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


sys.addaudithook(_audit)
_exec_module = importlib._bootstrap_external._LoaderBasics.exec_module


def _exec_module_switched_off(self, module):
    """The import system's exec_module, with the answer switched off in what it executed again."""
    library = _module_name_of(module) is not None
    _LOADING[0] += library
    try:
        _exec_module(self, module)
    finally:
        _LOADING[0] -= library
    if _RUN is not None:
        _switch_off_in(module, _RUN["saved"])


@contextlib.contextmanager
def switched_off(names: tuple[str, ...], why: str = "it is the library's own answer; write it yourself",
                 student=None):
    """While the student's file (`student`, its path) is loaded and run, each "module:attribute" of
    `names` (the library's own answer to the exercise, and the siblings that compute it) refuses,
    saying `why`, however it is reached (see above). "module:Class.method" switches off one method."""
    global _RUN
    if _RUN is not None:  # nested: the outer switch-off holds
        yield
        return
    saved: list = []
    student = os.path.abspath(student) if student else ""
    _RUN = {"base": sys._getframe(2), "student": student, "off": {},
            "cached": student and importlib.util.cache_from_source(student),
            "saved": saved}
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules)
              if name in _CHECKER_MODULES or name.startswith(("checks", "answers", "tests."))}
    library = {name: (module, dict(module.__dict__)) for name, module in list(sys.modules.items())
               if name == "minipar" or name.startswith("minipar.")}  # as it was: a reload is undone after
    importlib._bootstrap_external._LoaderBasics.exec_module = _exec_module_switched_off
    try:
        originals: dict[int, tuple] = {}
        for name in names:  # every module first: one may subclass another's class (zero3's of zero's)
            importlib.import_module(name.split(":")[0])
        for name in names:
            module_name, path = name.split(":")
            _RUN["off"].setdefault(module_name, {})[path] = why
            *owners, attr = path.split(".")
            holder = importlib.import_module(module_name)
            for owner in owners:
                holder = getattr(holder, owner)
            original = getattr(holder, attr)
            refuse = _refusing(original, f"{module_name}.{path}", why)
            saved.append((holder, attr, original))
            setattr(holder, attr, refuse)
            if not owners:
                originals[id(original)] = (original, refuse)
        for module in list(sys.modules.values()) + list(hidden.values()):  # every module that holds one
            found = getattr(module, "__dict__", None)
            if not isinstance(found, dict):
                continue
            for key, value in list(found.items()):
                hit = originals.get(id(value))
                if hit is not None and value is hit[0]:
                    saved.append((module, key, value))
                    setattr(module, key, hit[1])
        yield
    finally:
        importlib._bootstrap_external._LoaderBasics.exec_module = _exec_module
        for holder, attr, original in reversed(saved):
            setattr(holder, attr, original)
        for name, (module, attributes) in library.items():  # what a reload or a fresh import replaced
            sys.modules[name] = module
            module.__dict__.update(attributes)
        _unbind_refusers()
        sys.modules.update(hidden)
        _REFUSERS.clear()
        _RUN = None


def _unbind_refusers() -> None:
    """A library module first imported while the answer was off (a student's `from minipar.tensor_parallel
    import all_reduce` imports tensor_parallel then) bound the stand-ins, not the originals: give each
    module of the library the originals back, or a later check in this process would meet the stand-in."""
    for name, module in list(sys.modules.items()):
        if name == "minipar" or name.startswith("minipar."):
            for key, value in list(vars(module).items()):
                hit = _REFUSERS.get(id(value))
                if hit is not None and hit[0] is value:
                    setattr(module, key, hit[1])


def guarded(rank_fn, off: tuple[str, ...] = (), why: str | None = None):
    """Run one rank's check; report a skeleton or a crash as a line, not a traceback. `off`: the
    library's functions switched off (switched_off, saying `why`) while the student's file loads and runs."""
    def run(rank, world, path, *args):
        try:
            with switched_off(off, *([why] if why else []), student=path):
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


# The layouts an implement exercise runs on: (world size, group size). (4, 2) is two groups of two
# ranks, {0, 1} and {2, 3}: an answer that uses the world, or divides by its size, fails there.
LAYOUTS = ((2, 2), (4, 4), (4, 2))


def on_ranks(rank_fn_guarded, path, run_ranks, layouts=LAYOUTS, *args) -> list[str]:
    """The problems of the first layout (of `layouts`) at which some rank found one."""
    for world, group_size in layouts:
        problems = collect(run_ranks(world, rank_fn_guarded, str(path), group_size, *args))
        if problems:
            return problems
    return []


def world_group(name: str, size: int | None = None):
    """A minipar Group with its own ledger: the whole world, or (size) this rank's group of `size`
    consecutive ranks (every rank makes every group, as torch.distributed requires)."""
    import torch.distributed as dist

    from minipar.collectives import Group, Ledger
    world = dist.get_world_size()
    if size is None or size == world:
        return Group(name, dist.group.WORLD, list(range(world)), Ledger())
    mine = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        pg = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = Group(name, pg, ranks, Ledger())
    return mine


def where(rank: int, world: int, group, dim: str) -> str:
    """How a problem line names the rank and its layout: "rank 1: dp=2" or "rank 3: dp=2 (ranks [2, 3] of 4)"."""
    if group.size == world:
        return f"rank {rank}: {dim}={world}"
    return f"rank {rank}: {dim}={group.size} (its group: ranks {group.ranks} of {world}; the group, not the world)"


def storage_numel(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


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
    """'' when value is within rel of truth; else that it is not (never which way: a direction would
    let an answer be found by bisecting instead of worked out)."""
    if value is None:
        return "not a number"
    if abs(value - truth) <= rel * abs(truth):
        return ""
    return "wrong"


def number_problems(answer, truth: float, rel: float, what: str, how: str) -> list[str]:
    """[] when answer is within `rel` of truth, else one line saying that it is not."""
    off = _off(as_number(answer), truth, rel)
    return [f"ANSWER = {answer!r}: not {what}: {off} ({how})"] if off else []


def numbers_problems(answer, truths: tuple, rel: float, names: tuple, how: str) -> list[str]:
    """The same for a tuple of numbers, naming each one that is off."""
    if not isinstance(answer, (tuple, list)) or len(answer) != len(truths):
        return [f"ANSWER = {answer!r}: write {len(truths)} numbers, ({', '.join(names)})"]
    wrong = [f"{name}: {a!r} is not it" + (f", {off}" if off != "wrong" else "")
             for name, a, t in zip(names, answer, truths) if (off := _off(as_number(a), t, rel))]
    return [f"ANSWER = {tuple(answer)!r}: " + "; ".join(wrong) + f" ({how})"] if wrong else []


def choice_problems(answer, truth, choices: dict, how: str) -> list[str]:
    """A multiple choice: answer must be the key of `choices` (case-insensitive) that is true."""
    key = str(answer).strip().upper()
    if key not in choices:
        return [f"ANSWER = {answer!r}: write one of {', '.join(map(repr, choices))}"]
    return [] if key == truth else [f"ANSWER = {answer!r}: not {choices[key]} ({how})"]


# -- Predict: the question's numbers drawn from a seed, so that the answer is no look-up -----------

def seed_of(written: dict, override: int | None = None) -> tuple[int, str]:
    """(the seed, where it came from): `override` (the tests), the file's SEED, or the user's name."""
    if override is not None:
        return override, "given"
    if isinstance(written.get("SEED"), int):
        return written["SEED"], "SEED in your file"
    user = getpass.getuser()
    return zlib.crc32(user.encode()) % 1000, f"from your user name {user!r}; set SEED in the file to change it"


# -- Predict: the answer is a number or a choice written out, never code; a few tries per variant --

class NotAValue(Exception):
    pass


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node):
    """A written-out value: a number (arithmetic of numbers too, 3 / 7 exactly), a string, or a list,
    tuple or dict of them; anything else (a name, a call, a lambda) is code."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)) and not isinstance(
            node.value, bool):
        return Fraction(node.value) if isinstance(node.value, int) else node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return type(node.elts)(_value(e) for e in node.elts) if isinstance(node, ast.List) else tuple(
            _value(e) for e in node.elts)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_value(k): _value(x) for k, x in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_number(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _number(node.left), _number(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise NotAValue("a power that large")
        return _OPS[type(node.op)](left, right)
    raise NotAValue(ast.unparse(node))


def _number(node):
    x = _value(node)
    if isinstance(x, (str, list, tuple)):
        raise NotAValue(ast.unparse(node))
    return x


def _plain(x):
    """Fractions back to ints where whole (a choice of 3 stays 3), lists as they were written."""
    if isinstance(x, Fraction):
        return int(x) if x.denominator == 1 else float(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(e) for e in x)
    if isinstance(x, dict):
        return {_plain(k): _plain(e) for k, e in x.items()}
    return x


def written_values(path) -> dict:
    """SEED and ANSWER as the student's file writes them, read without running the file: a value
    written out, or NotAValue (ANSWER = a call, a function, a name: code, which a prediction is not)."""
    found = {}
    try:
        tree = ast.parse(Path(path).read_text(), str(path))
    except SyntaxError as e:
        return {"unparsed": f"line {e.lineno}: {e.msg}"}
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else [])
        for target in targets:
            if isinstance(target, ast.Name) and target.id in ("SEED", "ANSWER"):
                if isinstance(node.value, ast.Constant) and node.value.value is None:
                    found[target.id] = None
                    continue
                try:
                    found[target.id] = _plain(_value(node.value))
                except (NotAValue, ZeroDivisionError, OverflowError) as e:
                    found[target.id] = NotAValue(str(e))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in (
                "SEED", "ANSWER"):
            found[node.name] = NotAValue(f"def {node.name}")
    return found


# Tries: a variant takes MAX_TRIES different wrong answers; then its key stays unchecked (a new SEED
# draws a new variant). Kept per user in this file; the tests point it elsewhere.
MAX_TRIES = 3
TRIES_FILE = Path.home() / ".cache" / "minipar" / "exercise_tries.json"


def _tries(key: str, answer, right: bool) -> int:
    """How many different wrong answers this variant has had, counting `answer` when it is wrong."""
    try:
        book = json.loads(TRIES_FILE.read_text())
    except (OSError, ValueError):
        book = {}
    wrong = book.setdefault(key, [])
    if len(wrong) >= MAX_TRIES:
        return len(wrong) + 1
    if not right and repr(answer) not in wrong:
        wrong.append(repr(answer))
        TRIES_FILE.parent.mkdir(parents=True, exist_ok=True)
        temporary = TRIES_FILE.with_name(f".{TRIES_FILE.name}.{os.getpid()}")
        temporary.write_text(json.dumps(book, indent=0))
        temporary.replace(TRIES_FILE)
    return len(wrong)


class Predict:
    """A predict exercise. `space`: every variant (a dict of the question's numbers), none of them a
    case the chapter prints; the seed picks one. `question(v)`: the question with v's numbers.
    `problems(answer, v)`: the answer against the library's key for v. `keys(v)`: the key as the
    chapters would print it (tests/test_exercises.py greps docs/ for each: none may appear).

    ANSWER in the student's file is a value written out (a number, a fraction like 3 / 7, a choice,
    a list of them), read without running the file: code that computes it is refused, and so is a
    variant's answer after MAX_TRIES different wrong ones. The reference answers in
    tests/exercises/answers/ write their variant's value, and a `formula(v)` the tests run on every
    variant."""

    def __init__(self, space: list[dict], question: Callable[[dict], str], problems: Callable, keys: Callable):
        self.space, self.question, self.problems, self.keys = space, question, problems, keys

    def variant(self, seed: int) -> dict:
        return self.space[random.Random(seed).randrange(len(self.space))]

    def asked(self, path, seed: int | None = None) -> str:
        """The line `make exercise` prints first: which variant, and its question."""
        seed, source = seed_of(written_values(path), seed)
        return f"your variant: seed {seed} ({source}): {self.question(self.variant(seed))}"

    def __call__(self, path, run_ranks=None, seed: int | None = None) -> list[str]:
        written = written_values(path)
        if "unparsed" in written:
            return [f"{path}: the file does not parse ({written['unparsed']}): write ANSWER = your value"]
        if isinstance(written.get("SEED"), NotAValue) or not isinstance(written.get("SEED"), (int, type(None))):
            return [f"SEED = {written['SEED']}: write a whole number (or None), not code"]
        seed = seed_of(written, seed)[0]
        v = self.variant(seed)
        answer = written.get("ANSWER")
        if answer is None:
            return [f"ANSWER: not answered yet (write your answer in the file): {self.question(v)}"]
        if isinstance(answer, NotAValue):
            return [f"ANSWER = {answer}: a prediction is a number (or a choice) written out, not code that "
                    f"computes it: work it out, then write the value"]
        problems = self.problems(answer, v)
        tried = _tries(hashlib.sha1(self.question(v).encode()).hexdigest()[:16], answer, not problems)
        if tried > MAX_TRIES:
            return [f"no tries left at this variant (seed {seed}): {MAX_TRIES} different wrong answers were given; "
                    f"set SEED in the file to another whole number for a new variant, and work it out first"]
        if problems:
            problems[-1] += f" [try {tried} of {MAX_TRIES} at this variant]"
        return problems
