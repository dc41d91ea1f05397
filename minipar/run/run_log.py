"""What a run shows: the progress bar, the log lines, the JSON log and wandb.

Per-step metrics are gathered from every rank over a group of their own (its own ledger: the
model's shows only training's traffic): the loss (from the ranks that compute it), each rank's
peak memory and pipeline idle time, and rank 0's exposed communication (comm_clock.py). Rank 0
writes them where the user asked: a line every `--log-every` steps, tqdm, and every record both
as one JSON object (`--log-json`, each carrying the run's id) and to wandb (offline unless the
user has logged in; a resumed run continues the same wandb run). Peak memory is the GPU's peak
allocation; on the CPU, the rise of the peak resident set once the data is ready.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from minipar.collectives import Group, Ledger, all_gather
from minipar.comm_clock import WaitClock, exposed_line
from minipar.mesh import Mesh
from minipar.run.config import TrainConfig
from minipar.run.paths import InputError, temporary_name
from minipar.run.step import take_expert_load

# Dense bfloat16 peak FLOP/s, for model FLOPs utilisation (MFU) on known GPUs.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


class RunLog:
    """Per-step metrics, gathered from every rank, written where the user asked for them."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, device: torch.device, interrupt=None):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.interrupt = interrupt  # ops/interrupt.py: whether this rank heard Ctrl-C travels in each step's gather
        self.world, self.is_main = dist.get_world_size(), dist.get_rank() == 0
        self.group = Group("log", dist.group.WORLD, list(range(self.world)), Ledger())  # module docstring
        self.clock = mesh.ledger.clock = WaitClock(cuda=device.type == "cuda")  # the model's waits, each step
        self.timed: list = []  # what begins and ends with each step (extras/profiling.py's StepProfiler)
        self.losses: list[float] = []
        self.extra: dict[str, Any] = {}  # figures the loop adds to each record (replica groups taking part)
        self.wandb: Any = None  # rank 0's wandb run, JSON log file and progress bar, from start()
        self.file: Any = None
        self.run_id: str | None = None  # --out's, in each JSON record (ops/run_folder.name_run)
        self.bar: Any = None
        self.memory_base = 0  # CPU: resident bytes when measuring began (launch: memory_baseline)

    def say(self, text: str) -> None:
        if self.is_main and text:
            tqdm.write(text, file=sys.stdout)

    def start(self, model_cfg, data, dtype, start: int) -> None:
        cfg = self.cfg
        self.tokens_per_step = cfg.global_batch * cfg.seq_len
        self.flops_per_step = model_cfg.flops_per_token(cfg.seq_len) * self.tokens_per_step
        self.peak = peak_flops(self.device)
        self.first = start
        self.say(f"model {cfg.model}: {model_cfg.num_params() / 1e6:.2f}M parameters, vocab {model_cfg.vocab_size} "
                 f"(the tokenizer's {data.vocab_size}), "
                 f"{data.num_windows} windows of {cfg.seq_len} tokens; {cfg.accum_steps} micro-batch(es) of "
                 f"{cfg.micro_batch} per rank per step; {self.device.type}, {dtype}")
        if cfg.val_fraction:
            batches = min(cfg.eval_batches, len(data.val_windows) // cfg.global_batch)
            self.say(f"validation: {data.val_docs} documents held out, {len(data.val_windows)} windows; the loss on "
                     f"{batches} batch(es) of them every {cfg.eval_every or cfg.steps} steps and at the end")
        if self.is_main:
            self.wandb = start_wandb(cfg) if cfg.wandb else None
            if self.wandb:
                where = self.wandb.settings.sync_dir
                self.say(f"wandb: offline, logged in {where} (wandb sync uploads it)" if self.wandb.offline
                         else f"wandb: {self.wandb.url}")
            named = Path(cfg.out) / "run_id"  # cli.check_paths named the run (ops/run_folder.py): records carry it
            self.run_id = named.read_text().strip() if named.exists() else None
            self.file = open_json_log(cfg.log_json, start, self.run_id) if cfg.log_json else None
            self.bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step")

    def tick(self, step: int) -> None:
        """Step `step` (from 0) begins: its clocks start (and, with --profile-steps, its trace)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        for timed in self.timed:
            timed.begin(step)
        self.clock.reset()
        self.t0 = time.perf_counter()

    def step(self, step: int, loss: float, grad_norm: float, lr: float, wrapper, pipeline) -> bool:
        """Gather, print and publish the step's record. True if any rank heard Ctrl-C: all stop here."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - self.t0
        for timed in self.timed:
            timed.end(step)
        record = self.record(step, loss, grad_norm, lr, dt, wrapper, pipeline)
        self.losses.append(record["loss"])
        if not self.is_main:
            return self.stop
        self.publish(record)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}")
        if step == self.first:
            held = record["held_bytes"]
            self.say(f"rank 0 holds {held['params'] / 2**20:.2f} MiB of parameters, {held['grads'] / 2**20:.2f} "
                     f"MiB of gradients, {held['optimizer'] / 2**20:.2f} MiB of optimizer state")
        if (step + 1) % self.cfg.log_every == 0 or step == self.first or step + 1 == self.cfg.steps:
            self.say(log_line(record, self.cfg.steps))
        return self.stop

    def publish(self, record: dict) -> None:
        """Rank 0: one record of figures (its "step" says which) to the JSON log and to wandb."""
        if self.cfg.log_json:
            self.file = self.file or open(Path(self.cfg.log_json).expanduser(), "x")  # made with its first record
            self.file.write(json.dumps({"run_id": self.run_id, **record}) + "\n")
            self.file.flush()
        if self.wandb:
            self.wandb.log(flatten(record), step=record["step"])

    def record(self, step, loss, grad_norm, lr, dt, wrapper, pipeline) -> dict:
        """Every rank's loss, peak memory, pipeline idle time and whether it heard Ctrl-C, gathered. The
        loss is the mean over the ranks that compute it (the last pipeline stage; all ranks without pp)."""
        has_loss, heard = pipeline is None or pipeline.holds_last(), getattr(self.interrupt, "at", None) is not None
        peak = peak_memory_bytes(self.device) - self.memory_base
        mine = [loss, float(peak), float(has_loss), pipeline.bubble if pipeline else 0.0, float(heard)]
        metrics = all_gather(torch.tensor(mine, dtype=torch.float64, device=self.device), self.group)
        metrics = metrics.view(self.world, 5).cpu()
        self.stop = bool(metrics[:, 4].max())  # a rank heard Ctrl-C: every rank read the same, and stops
        exposed = self.clock.by_kind()  # this rank's waits in the model's communication (CUDA: after step()'s sync)
        return {
            "step": step + 1, "grad_norm": grad_norm, "lr": lr,  # AdamW's; Muon's group's, as set this step:
            "muon_lr": next((g["lr"] for g in wrapper.optimizer.param_groups if g.get("muon")), None),
            "loss": (metrics[:, 0] * metrics[:, 2]).sum().item() / metrics[:, 2].sum().item(),
            "tokens_per_s": self.tokens_per_step / dt, "step_time_s": dt,
            "mfu": self.flops_per_step / dt / (self.world * self.peak) if self.peak else None,
            "bytes_sent": self.mesh.ledger.total_sent(), "sent_by_group": sent_by_group(self.mesh.ledger),
            "comm": self.mesh.ledger.snapshot(),
            "comm_exposed_s": exposed, "comm_exposed_share": sum(exposed.values()) / dt,
            "peak_memory": [int(m) for m in metrics[:, 1].tolist()],
            "bubble": metrics[:, 3].mean().item() if pipeline else None,  # measured: mean time spent waiting
            "held_bytes": wrapper.held_bytes(),  # this rank's, measured on its tensors
            "expert_load": take_expert_load(wrapper),  # MoE: this rank's assignments per expert, per block
            **self.extra,
        }

    def validation(self, step: int, loss: float, pipeline, windows: int) -> float:
        """The held-out loss, gathered as the training loss is (the mean over the ranks that hold
        it), printed, and written to the JSON log ({"step", "val_loss"}) and wandb."""
        has_loss = float(pipeline is None or pipeline.holds_last())
        mine = torch.tensor([loss * has_loss, has_loss], dtype=torch.float64, device=self.device)
        total = all_gather(mine, self.group).view(self.world, 2).sum(0).cpu()
        val = total[0].item() / total[1].item()
        if self.is_main:
            self.publish({"step": step + 1, "val_loss": val})
            self.say(f"step {step + 1:>5}/{self.cfg.steps} | val loss {val:.4f} | {windows} held-out windows")
        return val

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()
        if self.wandb:
            self.wandb.finish()


def log_line(r: dict, steps: int) -> str:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (cpu)"
    bubble = f"bubble {r['bubble']:.0%} | " if r["bubble"] is not None else ""
    muon = f" (muon {r['muon_lr']:.2e})" if r.get("muon_lr") is not None else ""  # AdamW's, then Muon's
    return (f"step {r['step']:>5}/{steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e}{muon} | grad {r['grad_norm']:.3f} "
            f"| "
            f"{r['tokens_per_s']:,.0f} tok/s | mfu {mfu} | peak mem {max(r['peak_memory']) / 2**20:,.0f} MiB | "
            f"{bubble}sent {r['bytes_sent'] / 2**20:.2f} MiB/step{per_group_sent(r)} | "
            f"{exposed_line(r['comm_exposed_s'], r['step_time_s'])}{expert_load(r)}")


def expert_load(r: dict) -> str:
    """The first MoE block's tokens per expert on rank 0, and its busiest expert against the mean."""
    if not r["expert_load"]:
        return ""
    load = r["expert_load"][0]
    return f" | experts {load} (max/mean {max(load) * len(load) / max(1, sum(load)):.2f})"


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set (Linux: KiB)


def memory_baseline(device: torch.device) -> int:
    """Peak memory counts from now on; returns what peak_memory_bytes' figures are to rise from. On
    the CPU (Linux) the peak resident set is reset to the current one, the baseline; on a GPU, and
    where /proc cannot reset it, the baseline is 0 and the peak is the process's since it began."""
    if device.type != "cpu" or not Path("/proc/self/clear_refs").exists():
        return 0
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak resident set size (ru_maxrss)
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # resident pages


def sent_by_group(ledger: Ledger) -> dict[str, int]:
    """This rank's bytes sent this step, by group."""
    groups: dict[str, int] = {}
    for (group, _op), entry in sorted(ledger.entries.items()):
        groups[group] = groups.get(group, 0) + entry.sent
    return groups


def per_group_sent(r: dict) -> str:
    """' (dp 3.50, tp 1.20 MiB)': the record's bytes sent by group, when more than one sent."""
    parts = [f"{g} {b / 2**20:.2f}" for g, b in r["sent_by_group"].items() if b]
    return f" ({', '.join(parts)} MiB)" if len(parts) > 1 else ""


def flatten(record, prefix: str = "") -> dict:
    """A record as wandb's flat figures: {"held_bytes": {"params": 8}} -> {"held_bytes/params": 8}, a
    list's items by index (peak_memory/0, peak_memory/1); None (no such figure here) is left out."""
    flat = {}
    for key, value in record.items() if isinstance(record, dict) else enumerate(record):
        if isinstance(value, (dict, list)):
            flat |= flatten(value, f"{prefix}{key}/")
        elif value is not None:
            flat[f"{prefix}{key}"] = value
    return flat


def peak_flops(device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""  # the CPU: none
    return next((f for key, f in PEAK_BF16_FLOPS.items() if key in name), None)


def open_json_log(path: str, start: int, run_id: str | None):
    """This run's JSON log, to append to (None: a new run's, made with its first record, so that a
    log is never empty). A run resumed at step `start` first drops its own records of the steps
    after it (a restart runs them again; ops/preflight.check_json_log made sure each is this run's) and
    marks where it resumed, {"step", "resumed": true}: a reader sees one value per step."""
    log = Path(path).expanduser()
    if not start and not log.exists():
        return None
    kept = [r for r in json_log_records(log) if r["step"] <= start] if log.exists() else []
    tmp = log.with_name(temporary_name())  # short: fits beside a name of any length that fits
    with open(tmp, "x") as f:
        f.writelines(json.dumps(r) + "\n" for r in [*kept, {"run_id": run_id, "step": start, "resumed": True}])
    os.replace(tmp, log)
    return open(log, "a")


def json_log_records(path: Path) -> list[dict]:
    """The records of a --log-json file; InputError (one line) if it is not JSON lines of records."""
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, a number too long, nested too deep
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
            raise InputError(f"--log-json {path} is not a run's JSON log (line {number} is not a JSON record "
                             f"with a step): give a new file")
        records.append(record)
    return records


def start_wandb(cfg: TrainConfig):
    """wandb on rank 0: online if the user has logged in (or set WANDB_MODE), otherwise offline. The
    run's id is kept in --out/wandb_run_id: a run that resumes there continues the same wandb run.
    Silent (its banner and its 30-line summary would bury the run's own lines) unless WANDB_SILENT is
    set: the run's log says in one line where the run is."""
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    mode: Any = os.environ.get("WANDB_MODE") or ("online" if wandb.login(prompt=False) else "offline")
    id_file = Path(cfg.out) / "wandb_run_id"
    id_file.parent.mkdir(parents=True, exist_ok=True)
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:12])
    return wandb.init(project="minipar", config=asdict(cfg), mode=mode, dir=cfg.out, id=id_file.read_text(),
                      resume="allow", allow_val_change=True)  # a resumed run may change --steps, the layout...
