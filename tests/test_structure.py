"""The shape the code promises its readers: a library small enough to read in an afternoon, files
that read in one sitting, no function too long to hold in one's head."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Every file of the package, in its subfolders too (pipeline/, planning/, run/).
LIBRARY = sorted((ROOT / "minipar").rglob("*.py"))


# The architecture refactor (issue 10) left the library at 4,000 lines. The budget after it grows
# only by what a new capability needs, stated here: hardening (validation, checkpoint safety,
# self-resume, one loss whatever the layout), expert parallelism, the estimator and planner
# (issue 12), and the bridge to the ecosystem: sampling, evaluation, Hugging Face interop (issue 13);
# then issue 13's data (tokenizer files, token files, streaming tokenisation, held-out validation:
# batches.py, validation.py) and run configuration (shape flags, --config files, the effective
# config, every figure to wandb: config_file.py, preflight.py).
# Issue 22's layout adds folders' docstrings and the run's plumbing split out of the loop (launch.py,
# saving.py, step.py: +150) and its one typed Groups and gradient-sync builder (grad_sync.py,
# +100); issue 23's one argument checker shared by every script (args.py, +300) and the checks of
# every file a run trusts before any process group (checkpoint_checks.py, the token cache's
# content key, corrupt checkpoints set aside, the process group's start under --timeout: +350).
# Issue 21's four more collectives (reduce, gather, scatter, barrier) and the schedule builders'
# worked examples (+100); issue 20's mixed precision (precision.py, fp32 masters and bf16 working
# copies in the one wrapper family, the estimator's widths: +300) and ZeRO++'s groundwork (nodes in
# the mesh and the ledger, block-wise quantization in quantize.py: +200). ZeRO++ itself (zeropp.py's
# qwZ, hpZ and qgZ, the mesh's per-node dp groups, planning/zeropp.py's bytes and memory: +330) and
# issue 21's Ulysses attention beside the ring, with its estimate (+90).
LINE_BUDGET = 4000 + 400 + 500 + 500 + 400 + 500 + 300 + 150 + 100 + 300 + 350 + 100 + 300 + 200 + 330 + 90


def test_the_library_stays_within_its_line_budget_and_400_lines_per_file():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in LIBRARY}
    assert sum(lengths.values()) <= LINE_BUDGET, sum(lengths.values())
    assert {n: k for n, k in lengths.items() if k > 400} == {}


def test_no_function_in_the_library_or_the_scripts_is_over_60_lines():
    long = []
    for path in LIBRARY + sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_no_script_imports_another_script_but_the_shared_helpers():
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    helpers = {"bench_common", "course_common"}
    for path in (ROOT / "scripts").glob("*.py"):
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


# Imports from the run's plumbing (minipar.run) that the layering still allows, each with why.
# The course (minipar's top level) and the machinery (pipeline/, planning/) import nothing else
# from it.
LAYERING_EXCEPTIONS = {
    # The planner searches layouts as TrainConfigs, so that each is checked by the run's own
    # TrainConfig.validate, and the estimator reads a layout from the object a run is given (every
    # field of it: the degrees, ZeRO, recompute, dtype, batch and schedule); a planning copy of
    # that object would restate every field and its checks.
    ("minipar.planning.estimate", "minipar.run.config"),
    ("minipar.planning.estimate_moe", "minipar.run.config"),
    ("minipar.planning.planner", "minipar.run.config"),
}


def test_the_course_and_its_machinery_never_import_the_runs_plumbing():
    graph = import_graph()
    upward = {(m, dep) for m, deps in graph.items() for dep in deps
              if dep.split(".")[:2] == ["minipar", "run"] and m.split(".")[:2] != ["minipar", "run"]}
    assert upward - LAYERING_EXCEPTIONS == set()
    assert LAYERING_EXCEPTIONS - upward == set()  # an exception nobody needs any more is removed


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
checkpoint.load(None, torch.nn.Linear(2, 2), {"tp": mesh.tp_group})
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
