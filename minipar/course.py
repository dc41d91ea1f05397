"""The course's map: its chapters in reading order, each with its document, the library files it
teaches (each file in exactly one chapter), its scripts and its reading time.

One map, read three ways. tests/test_structure.py holds the code to its order: a module imports only
its own chapter's modules or an earlier one's, so chapter n's code shows nothing of a later chapter.
The README's chapter table is written from it (`readme_table`; scripts/tools/docs_check.py and a
test fail when they differ). And a reader can take it as the order in which to open the files.
"""

from __future__ import annotations

from typing import NamedTuple


class Chapter(NamedTuple):
    number: str  # "0" ... "11", "3b": the tuple's order below is the reading order
    title: str
    doc: str  # its file under docs/
    files: tuple[str, ...]  # under minipar/; a folder's __init__.py goes with the folder's chapter
    scripts: tuple[str, ...]  # what it runs: scripts, or make targets
    minutes: int  # to read it and run its scripts, without the exercises
    also: str = ""  # what it reads of another chapter's files, in the table's words


CHAPTERS = (
    Chapter("0", "One device, and why it is not enough", "00_one_device.md", ("model.py", "course.py"),
            ("scripts/course/step_00_one_device.py",), 15),
    Chapter("1", "Collectives and the byte ledger", "01_collectives.md",
            ("collectives.py", "comm_clock.py", "autograd_ops.py", "order_check.py", "mesh.py", "placement.py"),
            ("scripts/course/step_01_collectives.py",), 30),
    Chapter("2", "Data parallelism by hand", "02_data_parallel.md", ("data_parallel.py",),
            ("scripts/course/step_02_data_parallel.py", "scripts/course/step_02b_dataparallel_vs_ddp.py"), 25),
    Chapter("3", "ZeRO, stages 1-3", "03_zero.md", ("zero.py", "zero3.py"), ("scripts/course/step_03_zero.py",), 40),
    Chapter("3b", "Mixed precision", "03b_mixed_precision.md", ("precision.py",),
            ("scripts/course/step_03b_mixed_precision.py", "scripts/tools/plot_precision.py"), 15),
    Chapter("3c", "ZeRO++ across nodes", "03c_zero_plus_plus.md", ("quantize.py", "zeropp.py"),
            ("scripts/course/step_03c_zero_plus_plus.py",), 15),
    Chapter("4", "Tensor and sequence parallelism", "04_tensor_parallel.md", ("tensor_parallel.py",),
            ("scripts/course/step_04_tensor_parallel.py", "scripts/course/step_04b_tp_overlap.py"), 50,
            "and the tensor step of `parallelize.py` (chapter 7)"),
    Chapter("4c", "Muon: the optimizer that needs the whole matrix", "04c_muon.md",
            ("muon.py",), ("scripts/course/step_04c_muon.py",), 20),
    Chapter("5", "Context parallelism", "05_context_parallel.md", ("context_parallel.py",),
            ("scripts/course/step_05_context_parallel.py", "scripts/course/step_05b_ulysses.py"), 50),
    Chapter("6", "Pipeline parallelism", "06_pipeline.md",
            ("pipeline/schedules.py", "pipeline/timeline.py", "pipeline/executor.py"),
            ("scripts/course/step_06_pipeline.py", "scripts/course/step_06b_zero_bubble_v.py"), 65),
    Chapter("7", "Expert parallelism (mixture of experts), and the seam that applies every parallelism",
            "07_expert_parallel.md", ("moe.py", "expert_parallel.py", "parallelize.py"),
            ("scripts/course/step_07_expert_parallel.py",), 45),
    Chapter("8", "Memory and choosing a layout", "08_memory_and_planning.md",
            ("layout.py", "planning/estimate.py", "planning/estimate_moe.py", "planning/estimate_zeropp.py",
             "planning/estimate_muon.py", "planning/traffic.py", "planning/planner.py"),
            ("scripts/course/step_08_plan.py", "scripts/course/step_08b_search_space.py",
             "scripts/course/step_08c_roofline.py", "scripts/course/step_08d_korthikanti.py",
             "scripts/tools/plan.py", "scripts/tools/plan_vs_published.py"), 40),
    Chapter("9", "All four dimensions at once", "09_4d.md", (), ("scripts/course/step_09_4d.py",), 20,
            "the chapters above, together (16 ranks)"),
    Chapter("10", "Appendix: operating minipar (the whole run: checks, data, loop, checkpoints, refusals)",
            "10_operating.md",
            ("run/config.py", "run/paths.py", "run/data.py", "run/batches.py", "run/step.py", "run/train.py",
             "run/validation.py", "run/run_log.py", "run/saving.py", "run/checkpoint.py", "run/launch.py", "ops/cli.py",
             "ops/command_line.py", "ops/config_file.py", "ops/args.py", "ops/preflight.py", "ops/checkpoint_checks.py",
             "ops/run_folder.py", "ops/interrupt.py", "ops/hang.py", "ops/agent.py", "extras/hf.py",
             "extras/generate.py", "extras/profiling.py"),
            ("scripts/train.py", "scripts/tools/trace_report.py", "scripts/tools/sample.py", "scripts/tools/eval.py",
             "scripts/tools/convert.py"), 35),
    Chapter("10b", "Fault tolerance: checkpoint-restart, its cost at scale, replica groups on torchft",
            "10b_fault_tolerance.md", ("extras/replicas.py",), ("scripts/train_ft.py", "make train-ft"), 30),
    Chapter("11", "Capstone: plan 70B on 64 GPUs, build selective recompute, prove it, plan again",
            "11_capstone.md", (), ("scripts/course/step_11_selective_recompute.py", "scripts/tools/plan.py",
                                   "make exercise N=11.1"), 60,
            "`parallelize.py` (`keep_expensive`), `planning/estimate.py`, `planning/planner.py`"),
)
ORDER = {c.number: i for i, c in enumerate(CHAPTERS)}


def chapter_of(path: str) -> Chapter:
    """The chapter that teaches the library file `path` (under minipar/, e.g. "run/train.py"); a
    folder's __init__.py is its folder's, the package's own is chapter 0's. KeyError if none does."""
    folder, _, name = path.rpartition("/")
    for chapter in CHAPTERS:
        if path in chapter.files or name == "__init__.py" and (
                not folder and chapter.number == "0" or any(f.startswith(folder + "/") for f in chapter.files)):
            return chapter
    raise KeyError(f"minipar/{path} belongs to no chapter: add it to minipar/course.py's CHAPTERS")


def readme_table() -> str:
    """The README's chapter table, written from CHAPTERS (docs_check.py compares the two)."""
    rows = ["| chapter | code | scripts | time |", "| --- | --- | --- | --- |"]
    for c in CHAPTERS:
        code = ", ".join(f"`{f}`" for f in c.files) + (" " if c.files and c.also else "") + c.also
        rows.append(f"| [{c.number}. {c.title}](docs/{c.doc}) | {code} | "
                    f"{', '.join(f'`{s}`' for s in c.scripts)} | {c.minutes} min |")
    return "\n".join(rows) + "\n"
