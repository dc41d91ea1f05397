"""Fault-tolerant training on this machine: torchft's lighthouse, two replica groups, a kill, a rejoin.

    .venv/bin/python scripts/train_ft.py                       (make train-ft)
    .venv/bin/python scripts/train_ft.py --kill-at 6,14,22 --kill-in-transfer --out runs/ft

Starts the lighthouse in this process, then each replica group as its own job (scripts/train.py
--replica-groups R --replica-group-id g; with --nproc-per-group N, under torchrun). Group 1 is
killed with SIGKILL, its whole process group at once, when its log reaches each step of
--kill-at, and started again at once: with a fresh model and nothing read from disk, it takes the
live state from group 0. --kill-in-transfer kills its first restart again *while* it applies that
state (the restart is told to pause there, MINIPAR_FT_PAUSE_IN_TRANSFER). Printed at the end,
step by step: how many groups took part, when one was dropped, when and from whom one took its
state. Every flag after `--` goes to train.py (the defaults train the tiny model in float64).

With --out, each group's log, JSON log and checkpoints are kept there (a new or empty folder,
built beside it and renamed into place at the end); without, in a temporary folder removed after.
On several machines, the same pieces by hand: README, "Fault tolerance".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from minipar.extras.replicas import check_settings, lost_gpu_hours  # noqa: E402
from minipar.ops.args import Parser, new_folder, positive_int, refusals  # noqa: E402
from minipar.ops.command_line import parse_args  # noqa: E402
from minipar.run.paths import InputError  # noqa: E402

CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")
RUN = ["--model=tiny", "--vocab-size=512", "--seq-len=32", "--global-batch=8", "--micro-batch=2", "--lr=1e-2",
       "--warmup=4", "--dtype=float64", "--no-wandb", "--timeout=30", f"--data={CORPUS}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """One replica group's job: its command line, and its attempts (each a process group of its own)."""

    def __init__(self, g: int, argv: list[str], folder: Path, nproc: int):
        self.g, self.argv, self.folder, self.nproc, self.attempt, self.proc = g, argv, folder, nproc, 0, None

    def start(self, pause_in_transfer: bool = False) -> None:
        self.attempt += 1
        launcher = [sys.executable] if self.nproc == 1 else [
            str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={self.nproc}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
               "PYTHONUNBUFFERED": "1",  # each line in the log as it is said: the kills follow the log
               **({"MINIPAR_FT_PAUSE_IN_TRANSFER": "30"} if pause_in_transfer else {})}
        self.name = f"group{self.g}_attempt{self.attempt}"  # its log, JSON log and checkpoints: its own
        self.log = self.folder / f"{self.name}.log"
        self.proc = subprocess.Popen([*launcher, str(ROOT / "scripts" / "train.py"), *self.argv,
                                      f"--out={self.folder / self.name}",
                                      f"--log-json={self.folder / self.name}.jsonl"],
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)  # its own process group: one kill takes every rank

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def last_step(self) -> int:
        """The last step this attempt logged (0: none yet)."""
        return max(map(int, re.findall(r"step +(\d+)/\d+ \|", self.text())), default=0)


def wait_for(what, group: Group, seconds: float = 120.0) -> None:
    """Poll until `what()` holds; a group that exits first (or a minute's wait) is an error with its log."""
    end = time.monotonic() + seconds
    while not what():
        if group.proc.poll() is not None or time.monotonic() > end:
            raise SystemExit(f"replica group {group.g} {'ended' if group.proc.poll() is not None else 'stalled'} "
                             f"before the event; its log:\n{group.text()[-3000:]}")
        time.sleep(0.05)


def group_argv(args, port: int) -> list[str]:
    """train.py's command line for every group (each adds its --replica-group-id, --out and --log-json)."""
    return [*RUN, f"--steps={args.steps}", f"--dp={args.dp}", "--log-every=1", f"--replica-groups={args.groups}",
            f"--lighthouse=localhost:{port}", *args.train_flags]


def check_groups(args) -> None:
    """train.py's own checks (parse_args, the replica groups' check_settings) of the command line each
    group will get, in its world of --nproc-per-group ranks, before the lighthouse and any group start: a mistake is one
    line here, not a group's log (or torchrun's traceback) after the others have started."""
    world = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(args.nproc_per_group)  # what parse_args checks the layout against
    try:
        check_settings(parse_args([*group_argv(args, port=29510), f"--replica-group-id={args.groups - 1}"]))
    except InputError as e:
        raise InputError(f"each group's train.py (--groups is its --replica-groups, --nproc-per-group its "
                         f"world size): {e}") from None
    finally:  # as it was
        if world is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = world


def demonstrate(args, folder: Path) -> list[str]:
    """Run the groups with the kills; returns the survivor's and the others' event lines."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust half, here and in each group: quiet unless asked
    from torchft.coordination import LighthouseServer

    port = free_port()
    lighthouse = LighthouseServer(bind=f"[::]:{port}", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    argv = group_argv(args, port)
    events: list[tuple[int, str]] = []
    groups = [Group(g, [*argv, f"--replica-group-id={g}"], folder, args.nproc_per_group) for g in range(args.groups)]
    try:
        for group in groups:
            group.start()
        victim = groups[1]
        for i, at in enumerate(args.kill_at):
            wait_for(lambda at=at: victim.last_step() >= at, victim)
            victim.kill()
            events.append((victim.last_step() + 1, f"harness: kill -9 of replica group 1 after its step "
                                                   f"{victim.last_step()}; started again"))
            victim.start(pause_in_transfer=args.kill_in_transfer and i == 0)
            if args.kill_in_transfer and i == 0:
                wait_for(lambda: "applying a peer's state" in victim.text(), victim)
                victim.kill()
                step = int(re.findall(r"step (\d+): replica group 1 is applying", victim.text())[-1])
                events.append((step, "harness: kill -9 of replica group 1 while it applies that state; started again"))
                victim.start()
        for group in groups:
            if group.proc.wait(timeout=300) != 0:
                raise SystemExit(f"replica group {group.g} failed; its log:\n{group.text()[-3000:]}")
    finally:
        for group in groups:
            if group.proc is not None and group.proc.poll() is None:
                group.kill()
        lighthouse.shutdown()
    return timeline(folder, events), summary(folder, groups, args.steps)


def timeline(folder: Path, events: list[tuple[int, str]]) -> list[str]:
    """Every group's lines about the replica groups, and the harness's kills, step by step."""
    for log in sorted(folder.glob("group*_attempt*.log")):
        for line in log.read_text().splitlines():
            found = re.search(r"step (\d+): (.*(replica group|not committed).*)", line)
            if found:
                events.append((int(found[1]), f"{log.stem.replace('_', ' ')}: {found[2]}"))
    for jsonl in sorted(folder.glob("group*_attempt*.jsonl")):  # the ledger's count of each state transfer
        for r in map(json.loads, jsonl.read_text().splitlines()):
            moved = {k: v["bytes"] for k, v in r["comm"].items() if k.endswith("_state")}
            if moved:
                events.append((r["step"], f"{jsonl.stem.replace('_', ' ')}: ledger: " + ", ".join(
                    f"{k} {n:,} bytes" for k, n in moved.items())))
    return [f"step {step:>4}  {text}" for step, text in sorted(events, key=lambda e: e[0])]


def summary(folder: Path, groups: list[Group], steps: int) -> list[str]:
    """What the run proves, in lines that are the same on every run of the same command."""
    survivor, victim = (folder / "group0_attempt1.log").read_text(), groups[1]
    sent = dict(re.findall(r"step (\d+): replica group 0 sends its state .*digest (\w+)", survivor))
    taken = [re.findall(r"step (\d+): replica group 1 applied it: digest (\w+)", (folder / f"group1_attempt{a}.log")
                        .read_text()) for a in range(1, victim.attempt + 1)]
    rejoins = [t for found in taken for t in found]
    halfway = sum("is applying" in (folder / f"group1_attempt{a}.log").read_text() and not taken[a - 1]
                  for a in range(1, victim.attempt + 1))
    steps_logged = [json.loads(r)["step"] for r in (folder / "group0_attempt1.jsonl").read_text().splitlines()]
    records = [json.loads(r) for jsonl in folder.glob("group*.jsonl") for r in jsonl.read_text().splitlines()]
    moved = {v["bytes"] for r in records for k, v in r["comm"].items() if k.endswith("_state")}
    lines = [f"group 0 logged steps {steps_logged[0]}..{steps_logged[-1]}: {len(steps_logged)} records, none missing "
             f"or repeated" if steps_logged == list(range(1, steps + 1)) else f"group 0's steps: {steps_logged}",
             f"the ledger's bytes of each state transfer, sent and received: {', '.join(f'{b:,}' for b in moved)}",
             f"group 1: killed {victim.attempt - 1} time(s), {halfway} of them while it applied a peer's state; "
             f"took group 0's state {len(rejoins)} time(s), each digest equal to the one sent: "
             f"{all(sent.get(s) == d for s, d in rejoins)}"]
    if victim.attempt > 1 and "took its state" not in victim.text():
        lines.append("group 1's last restart found the others finished: give more --steps to see it rejoin")
    ends = [folder / f"group{g.g}_attempt{g.attempt}" / f"step_{steps:06d}" for g in groups]
    tensors = [{**load_file(e / "model.safetensors"), **load_file(e / "optimizer.safetensors")} for e in ends]
    same = all(t.keys() == tensors[0].keys() and all(torch.equal(t[k], tensors[0][k]) for k in t) for t in tensors)
    weights = load_file(ends[0] / "model.safetensors")  # what a transfer carries, by its formula
    n, k = sum(t.numel() for t in weights.values()), len(weights)
    slots = {key.rsplit("/", 1)[1] for key in tensors[0] if key not in weights}
    if slots == {"exp_avg", "exp_avg_sq", "step"} and all(t.dtype == torch.float64 for t in weights.values()):
        lines.insert(2, f"  = {n:,} parameters x 8 B (float64) x 3 (weights, AdamW's two moments) + 4 B x {k} "
                        f"tensors (AdamW's step counts) = {24 * n + 4 * k:,}")  # the defaults; other flags: no formula
    lines.append(f"after step {steps}, every group's weights and AdamW state bitwise equal: {same}")
    return lines


def costs() -> list[str]:
    """--costs: what failures cost Llama 3 405B's run, restarting from checkpoints or losing one replica
    group at a time (extras/replicas.py's lost_gpu_hours), then what the group's count leaves out. The
    figures are the paper's (Dubey et al. 2024, section 3.3.4 and Table 5: 419 unexpected interruptions
    of the job, from every cause, in 54 days on 16,384 GPUs; tp 8 x pp 16 x dp 128; a 16M-token batch;
    38-43% MFU); the restart time, the checkpoint intervals and the 40% MFU are assumptions. Whether a
    group of tp 8 x pp 16 holds the model is minipar's estimator's answer (planning/estimate.py)."""
    from minipar.layout import Layout
    from minipar.model import CONFIGS
    from minipar.planning.estimate import peak_bytes

    gpus, hours, failures, restart, group = 16384, 54 * 24, 419, 10 / 60, 8 * 16
    mtbf = gpus * hours / failures
    total = gpus * hours
    lines = [f"Llama 3 405B: {gpus:,} GPUs for {hours:,} hours, {failures} unexpected interruptions of the job",
             f"(every cause; GPU faults were 58.7% of them): one every {mtbf / gpus:.2f} hours, or, charged to",
             f"the GPUs, one per GPU every {mtbf:,.0f} hours",
             f"GPU-hours lost of {total:,}, each restart taking 10 minutes:"]
    rows = [(f"checkpoint-restart, a save every {m:>2} min",
             lost_gpu_hours(gpus, mtbf, hours, restart, checkpoint_every_hours=m / 60)) for m in (60, 30, 6)]
    grouped = lost_gpu_hours(gpus, mtbf, hours, restart, group_gpus=group)
    rows.append((f"replica groups of {group} GPUs (tp 8 x pp 16)", grouped))
    lines += [f"  {name}:  {lost:>12,.0f}  ({lost / total:.2%})" for name, lost in rows]
    # What the group's count leaves out: at each failure every GPU waits for the failed allreduce
    # (at most torchft's timeout, 60 s by default) and redoes the step in flight.
    step_s = 6 * 405e9 * 16 * 2**20 / (gpus * 989e12 * 0.40)  # 6 N D FLOPs at 40% of an H100's bf16 peak
    redo = failures * gpus * step_s / 3600
    stall = failures * gpus * 60 / 3600
    lines += [f"  + every GPU redoes the step in flight ({step_s:.1f} s):  {redo:>12,.0f}  ({redo / total:.2%})",
              f"  + every GPU waits torchft's 60 s timeout, at worst:  {stall:>12,.0f}  ({stall / total:.2%})",
              f"  replica groups, all told: between {(grouped + redo) / total:.2%} and "
              f"{(grouped + redo + stall) / total:.2%}; the stall alone is {stall / grouped:.1f} times the "
              "group's restarts"]
    fits = []
    for recompute in (False, True):
        layout = Layout(model="405b", tp=8, pp=16, sp=True, seq_len=8192, micro_batch=1, global_batch=16,
                        precision="bf16-mixed", recompute=recompute)
        fits.append(peak_bytes(CONFIGS["405b"], layout) / 1e9)
    return lines + ["does a group of tp 8 x pp 16 hold 405B (seq 8,192, micro-batch 1, bf16-mixed, sp)? the "
                    "estimator's peak:", f"  {fits[0]:.1f} GB per GPU without recompute, {fits[1]:.1f} GB with "
                    f"full recompute, of {80 * 0.9:.0f} GB usable (80 GB less 10%)"]


def kill_steps(text: str) -> list[int]:
    """--kill-at: steps in increasing order, e.g. 6,14,22 ('' kills nothing)."""
    steps = [positive_int(part) for part in text.split(",") if part.strip()]
    if steps != sorted(set(steps)):
        raise argparse.ArgumentTypeError(f"{text!r}: give steps in increasing order, e.g. 6,14,22")
    return steps


def main(argv=None) -> int:
    p = Parser(prog="train_ft.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=positive_int, default=2, help="replica groups, 2 or more (group 1 is killed)")
    p.add_argument("--nproc-per-group", type=positive_int, default=1, help="ranks in each group (torchrun when more "
                   "than 1)")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel ranks inside each group")
    p.add_argument("--steps", type=positive_int, default=600,
                   help="enough for a restart (seconds) to find the survivor still training")
    p.add_argument("--kill-at", type=kill_steps, default=[20], help="kill group 1 when its log reaches these steps")
    p.add_argument("--kill-in-transfer", action="store_true", help="and kill its first restart while it takes state")
    p.add_argument("--out", default=None, help="keep the groups' logs and checkpoints here (a new or empty folder)")
    p.add_argument("--costs", action="store_true", help="print what failures cost a run at scale, and exit")
    p.add_argument("train_flags", nargs="*", help="after --: more train.py flags")
    with refusals():
        args = p.parse_args(argv)
        if args.groups < 2:
            raise InputError(f"--groups {args.groups}: give 2 or more (group 1 is the one killed)")
        if any(k >= args.steps for k in args.kill_at):
            raise InputError(f"--kill-at {max(args.kill_at)}: give steps before --steps {args.steps}")
        if args.costs:
            defaults = vars(p.parse_args([]))
            named = [k for k, v in vars(args).items() if k != "costs" and v != defaults[k]]
            if named:  # it would ignore them
                flag = "the train.py flags after --" if named[0] == "train_flags" else f"--{named[0].replace('_', '-')}"
                raise InputError(f"--costs prints figures and runs nothing: leave out {flag}")
            print("\n".join(costs()))
            return 0
        check_groups(args)
        if args.out:
            with new_folder(args.out, "--out") as folder:
                steps, proven = demonstrate(args, folder)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                steps, proven = demonstrate(args, Path(tmp))
    print("\n".join(["what happened, step by step:", *steps, "", *proven]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
