"""`--profile-steps A:B`: torch.profiler over steps A to B (counted from 1, as the log counts them),
on every rank, and one Chrome-trace JSON per rank: `<out>/traces/steps_A-B/rank<R>.pt.trace.json`.

The trace holds this rank's operators (aten ops on the CPU; on a GPU its kernels too), each step
as a range `ProfilerStep#N` (the name TensorBoard and Holistic Trace Analysis look for), and every
message of the ledger as a range named by the clock (comm_clock.py): 'minipar dp: dp/all_reduce
65536 B' for a blocking call, ', posted #7' and ', wait #7' for a posted one and its wait. The
folder is new for each run: the launch refuses one that exists (nothing is written over). Without
the flag nothing here runs: no profiler, no ranges, no listener on the ledger. A plug-in (cli.py
hands it to the run): `hooks_for` puts a StepProfiler among the run log's timed steps.

Open a file in ui.perfetto.dev, or `tensorboard --logdir <out>/traces` (with torch-tb-profiler);
scripts/tools/trace_report.py reads the folder and says, per rank, how much communication hid behind
computation and where the step's time went.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from minipar.collectives import Ledger
from minipar.comm_clock import WaitClock
from minipar.run.config import TrainConfig
from minipar.run.run_log import RunLog


def trace_folder(cfg: TrainConfig) -> Path:
    """Where this run's traces go: a folder of --out named for the steps."""
    first, last = cfg.profiled()
    return Path(cfg.out).expanduser() / "traces" / f"steps_{first}-{last}"


def traces_in_the_way(cfg: TrainConfig) -> str | None:
    """Why this run's traces could not be written, or None. Found only after the last profiled step,
    it would end the run there, unsaved: a `traces` that is no folder (a file, a FIFO, a broken
    link) or one this rank cannot write in, or the steps' folder there already (never written over)."""
    folder = trace_folder(cfg)
    if os.path.lexists(folder.parent) and not folder.parent.is_dir():
        return f"{folder.parent} is not a folder, and the traces go into it: move it away, or give another --out"
    if folder.parent.is_dir() and not os.access(folder.parent, os.W_OK | os.X_OK):
        return f"cannot write in {folder.parent}: make it writable, or give another --out"
    if os.path.lexists(folder):
        return (f"{folder} exists (an earlier run's traces) and nothing is written over it: move it away, or give "
                f"other steps or another --out")
    return None


class StepProfiler:
    """Starts torch.profiler before step A, ranges each step, and writes the trace after step B."""

    def __init__(self, cfg: TrainConfig, clock: WaitClock, ledger: Ledger, device: torch.device):
        (self.first, self.last), self.folder = cfg.profiled(), trace_folder(cfg)
        self.clock, self.ledger, self.device = clock, ledger, device
        self.profiler: profile | None = None
        self.step_range: record_function | None = None

    def begin(self, step: int) -> None:
        """Before step `step` (from 0): at step A, the profiler starts and the clock names messages."""
        if step + 1 == self.first:
            cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self.profiler = profile(activities=[ProfilerActivity.CPU, *cuda])
            self.profiler.start()
            atexit.register(self.profiler.stop)  # a run stopped mid-trace writes none; left running, exit segfaults
            self.clock.noted = []
            self.ledger.listeners.append(self.clock.note)
        if self.profiler is not None:
            self.step_range = record_function(f"ProfilerStep#{step + 1}")
            self.step_range.__enter__()

    def end(self, step: int) -> None:
        """After step `step`'s work (and CUDA's synchronize): the step's range ends; after step B the
        profiler stops and this rank's trace is written."""
        if self.profiler is None:
            return
        self.step_range.__exit__(None, None, None)
        if step + 1 == self.last:
            self.profiler.stop()
            atexit.unregister(self.profiler.stop)
            self.ledger.listeners.remove(self.clock.note)
            self.clock.noted = None
            self.folder.mkdir(parents=True, exist_ok=True)  # every rank writes its own file into it
            final = self.folder / f"rank{dist.get_rank()}.pt.trace.json"
            self.profiler.export_chrome_trace(str(final.with_suffix(".part")))  # renamed once whole: never half a trace
            final.with_suffix(".part").rename(final)
            self.profiler = None


def check(cfg: TrainConfig) -> None:
    """Nothing to check before the run: cli.check_profiled_steps checks --profile-steps against --out."""


def hooks_for(cfg: TrainConfig, mesh, wrapper, log: RunLog) -> None:
    """The plug-in's part: no step hooks; with --profile-steps, a StepProfiler timed with each step."""
    if cfg.profile_steps:
        log.timed.append(StepProfiler(cfg, log.clock, mesh.ledger, log.device))
