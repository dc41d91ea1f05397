"""The shape the code promises its readers: a library small enough to read in an afternoon, files
that read in one sitting, no function too long to hold in one's head."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minipar import course

ROOT = Path(__file__).resolve().parents[1]
# Every file of the package, in its subfolders too (pipeline/, planning/, run/).
LIBRARY = sorted((ROOT / "minipar").rglob("*.py"))


# The library in tiers, each a folder with its own budget, set here and nowhere else. The course core
# (chapters 0-8: minipar/ itself, pipeline/, planning/) is what a student reads in order; run/ is the
# loop chapter 10 reads; ops/ (the command line and what protects a run) and extras/ (plug-ins beyond
# the course: replica groups, profiling, Hugging Face, generation) are counted, not capped.
TIERS = {"core": ("minipar/*.py", "minipar/pipeline/*.py", "minipar/planning/*.py"), "run": ("minipar/run/*.py",),
         "ops": ("minipar/ops/*.py",), "extras": ("minipar/extras/*.py",)}
BUDGETS = {"core": 5_700, "run": 1_800}


def tier_lines() -> dict[str, int]:
    return {tier: sum(len(p.read_text().splitlines()) for g in globs for p in ROOT.glob(g))
            for tier, globs in TIERS.items()}


def test_each_tier_stays_within_its_budget_and_every_file_within_400_lines():
    lines = tier_lines()
    assert sum(lines.values()) == sum(len(p.read_text().splitlines()) for p in LIBRARY)  # every file in a tier
    assert {t: n for t, n in lines.items() if n > BUDGETS.get(t, n)} == {}, lines
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in LIBRARY}
    assert {n: k for n, k in lengths.items() if k > 400} == {}


def test_the_loop_imports_nothing_from_planning_ops_or_extras():
    graph = import_graph()
    reached = {(m, d) for m, deps in graph.items() if m.startswith("minipar.run.") for d in deps
               if d.startswith(("minipar.ops", "minipar.extras", "minipar.planning"))}
    assert reached == set(), sorted(reached)  # the Layout it reads is the core's own (minipar/layout.py)


def test_no_function_in_the_library_or_the_scripts_is_over_60_lines():
    long = []
    for path in LIBRARY + sorted((ROOT / "scripts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_no_script_imports_another_script_but_the_shared_helpers():
    scripts = {p.stem for p in (ROOT / "scripts").rglob("*.py")}
    helpers = {"bench_common", "course_common"}
    for path in (ROOT / "scripts").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not [n for n in names if n in scripts - helpers], (path.name, names)


# ----------------------------------------------------------------------------------------------
# Layering: who may import whom inside minipar
# ----------------------------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(path: Path, modules: set[str]) -> set[str]:
    """The minipar modules `path` imports anywhere in it: at the top, inside functions, or under
    TYPE_CHECKING (a cycle of annotations is still a cycle for the reader)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base] * bool(base))
            names = [base] + [f"{base}.{a.name}" for a in node.names]  # `from pkg import module` too
        else:
            continue
        for name in names:
            while name and name not in modules:  # minipar.x.y.Class -> minipar.x.y
                name = name.rpartition(".")[0]
            if name and name != here:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p) for p in LIBRARY}
    return {module_name(p): internal_imports(p, modules) for p in LIBRARY}


def test_the_import_graph_reads_at_least_the_imports_we_know_of():  # the checks below could not fail otherwise
    graph = import_graph()
    assert "minipar.pipeline.schedules" in graph["minipar.pipeline.timeline"]
    assert "minipar.collectives" in graph["minipar.pipeline.executor"]
    assert "minipar.run.config" in graph["minipar.run.train"]


def test_no_module_of_the_package_imports_itself_through_others():
    graph, cycles = import_graph(), []

    def visit(module: str, path: list[str], state: dict[str, str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep], state)
        state[module] = "done"

    state: dict[str, str] = {}
    for module in sorted(graph):
        if module not in state:
            visit(module, [module], state)
    assert cycles == []


# The course's order is the import order: each module belongs to one chapter of the course's map
# (minipar/course.py, the README's resolution: 0, 1, 2, 3, 3b, 3c, 4, ... 10, 10b, 11) and imports only
# modules of its own chapter or earlier ones, so a student who opens chapter n's code meets nothing of
# a later chapter. No module is excused.
def chapter_of(module: str) -> str:
    """The chapter (its number) that teaches `module` (minipar.run.train); KeyError if none does."""
    path = next(p for p in LIBRARY if module_name(p) == module).relative_to(ROOT / "minipar").as_posix()
    return course.chapter_of(path).number


def inversions(graph: dict[str, set[str]], chapter=chapter_of) -> list[str]:
    """Every import of a later chapter's module, as 'importer (chapter) -> imported (chapter)'."""
    return [f"{m} ({chapter(m)}) -> {dep} ({chapter(dep)})" for m, deps in sorted(graph.items())
            for dep in sorted(deps) if course.ORDER[chapter(dep)] > course.ORDER[chapter(m)]]


def test_every_module_belongs_to_one_chapter_and_the_map_names_only_files_that_exist():
    modules = set(import_graph())
    assert {m: chapter_of(m) for m in modules}  # KeyError names a module no chapter has
    named = [f for c in course.CHAPTERS for f in c.files]
    assert sorted(set(named)) == sorted(named)  # no file in two chapters
    assert {f for f in named if not (ROOT / "minipar" / f).is_file()} == set()


def test_every_course_script_is_in_the_map_and_every_script_it_names_exists():
    named = {s for c in course.CHAPTERS for s in c.scripts if not s.startswith("make ")}
    assert {f"scripts/course/{p.name}" for p in (ROOT / "scripts" / "course").glob("step_*.py")} <= named
    assert {s for s in named if not (ROOT / s).is_file()} == set()


def test_no_module_imports_a_later_chapter():
    assert inversions(import_graph()) == []


def test_an_import_of_a_later_chapter_is_found_wherever_it_is():  # the check above could not fail otherwise
    planted = {"minipar.model": {"minipar.collectives"}, "minipar.zero3": {"minipar.precision", "minipar.zero"},
               "minipar.pipeline.executor": {"minipar.run.train"}, "minipar.run.train": {"minipar.parallelize"},
               "minipar.run.step": {"minipar.extras.replicas"}, "minipar.zeropp": {"minipar.zero3"}}
    assert inversions(planted) == ["minipar.model (0) -> minipar.collectives (1)",
                                   "minipar.pipeline.executor (6) -> minipar.run.train (10)",
                                   "minipar.run.step (10) -> minipar.extras.replicas (10b)",
                                   "minipar.zero3 (3) -> minipar.precision (3b)"]
    with pytest.raises(KeyError, match="minipar/nowhere.py belongs to no chapter"):
        course.chapter_of("nowhere.py")


def test_the_readmes_chapter_table_is_written_from_the_map():
    readme = (ROOT / "README.md").read_text()
    assert course.readme_table() in readme, "run scripts/tools/docs_check.py --write-table"
    assert all(f"`{f}`" in course.readme_table() for c in course.CHAPTERS for f in c.files)


# Calls the type checker must refuse: each passes a function or a dict where a signature asks for a
# Group or the mesh's Groups (the mistakes `mesh.reduction_group` and `mesh.shard_groups()` once were).
WRONG_CALLS = '''
import torch
from minipar.collectives import all_reduce
from minipar.data_parallel import DataParallel
from minipar.mesh import Mesh
from minipar.run import checkpoint

mesh = Mesh.build()
all_reduce(torch.zeros(1), mesh.groups().reduction)
DataParallel(torch.nn.Linear(2, 2), mesh.group)
checkpoint.load(None, torch.nn.Linear(2, 2), {"tp": mesh.groups().tp})
'''


def test_the_type_checker_passes_the_library_and_refuses_a_method_or_dict_where_a_group_is_expected(tmp_path):
    pytest.importorskip("mypy", reason="the type checker is in the dev extra: make setup installs it")
    wrong = tmp_path / "wrong_calls.py"
    wrong.write_text(WRONG_CALLS)
    proc = subprocess.run([sys.executable, "-m", "mypy", "minipar", str(wrong)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "MYPYPATH": str(ROOT)}, timeout=600)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    # (by name: from its cache, mypy may report an unchanged file under the path it first saw)
    assert [e for e in errors if Path(e.split(":")[0]).name != wrong.name] == []  # the library itself passes
    lines = WRONG_CALLS.splitlines()
    refused = {int(e.split(":")[1]) for e in errors}
    assert refused == {i + 1 for i, line in enumerate(lines) if line.startswith(("all_reduce", "DataParallel",
                                                                                 "checkpoint.load"))}, proc.stdout
