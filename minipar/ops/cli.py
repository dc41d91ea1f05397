"""The command line of scripts/train.py: parse it, check everything checkable before any process
group, then run (run/launch.py) or become torchrun's agent (agent.py). The operating tier: what
protects a run and its user, not what the course teaches (chapter 10 reads it; skip it at first).

    main                    parse the command line and check it (command_line.py); --plan, --print-config: print
      start_workers         given --nproc-per-node: the same checks once, then torchrun's agent, in-process (agent.py)
      check_memory          the estimator's peak per rank must fit (planning/)
      check_extras          the plug-ins' checks (minipar/extras/: replica groups ask their lighthouse)
      check_paths           data, the checkpoint to resume, --out (locked by rank 0)
      launch_watched        the process group (hang.py), then launch.launch: the mesh, the log, the data, the loop
      exit code             0 done; 2 bad input (one line); 3 the run diverged; 4 a rank stopped
                            answering within --timeout (hang_report names what it waited for,
                            and which ranks of the group never reached it: HangWatch listens
                            to the ledger for it); 130 Ctrl-C (interrupt.py): stopped after a
                            step all ranks agreed on, or at once at a second (a torchrun worker: 0)

Everything checkable is checked before torch.distributed starts: a bad command line costs one
line, not a hang. Under torchrun each worker asks Linux to end it when torchrun dies
(`exit_with_parent`); `--resume auto` lets `torchrun --max-restarts` continue from --out's newest
checkpoint.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from minipar.extras import profiling
from minipar.ops import run_folder
from minipar.ops.agent import agent_options, run_agent, torchrun_options
from minipar.ops.command_line import config_file_text, parse_args
from minipar.ops.hang import HangWatch, RankTimeout, hang_report, start_distributed, stopped_answering
from minipar.ops.interrupt import Interrupt
from minipar.ops.preflight import check_files
from minipar.planning.planner import check_memory, report
from minipar.run import checkpoint
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.data import DataError, find_files
from minipar.run.launch import launch
from minipar.run.saving import TrainingStopped


def main(argv=None, extras: Sequence = ()) -> int:
    """Parse, check, run. A bad command line or input prints one line and exits 2. Given torchrun's
    --nproc-per-node, this process checks the command line, then becomes torchrun (`start_workers`).
    `extras`: plug-ins from outside the run (scripts/train.py hands minipar/extras/replicas.py over),
    each with check(cfg), before any process group, and hooks_for(cfg, mesh, wrapper, log), the
    step hooks it adds to the loop (run/step.py) or None."""
    argv = sys.argv[1:] if argv is None else list(argv)
    agent, argv = torchrun_options(argv)
    if agent:
        return start_workers(agent, argv, extras)
    is_main = int(os.environ.get("RANK", "0")) == 0
    exit_with_parent()
    with Interrupt() as interrupt:  # Ctrl-C: stop at once; in the steps, after one every rank agreed on
        local = False  # the command line reads alike on every rank; memory and files are each node's own
        try:
            cfg = parse_args(argv)
            check_rendezvous()
            if printed_only(cfg):
                return 0
            local = True
            check_memory(cfg)  # weights, gradients, optimizer state and activations must fit
            check_extras(cfg, extras)  # before --out is made: a refused run leaves nothing
            resume = check_paths(cfg)
            interrupt.out = cfg.out
        except ValueError as e:  # ConfigError, LayoutError, DataError, CheckpointError
            if not is_main:  # rank 0 says what every rank found; a node's own problem its ranks say, after it
                if not local:
                    return after_rank0(2)
                time.sleep(2.0)  # if rank 0 failed too, torchrun has ended this rank by now
            where = "" if is_main else f"rank {os.environ['RANK']}: "
            print(f"minipar: error: {where}{e}", file=sys.stderr, flush=True)
            return 2
        try:
            return launch_watched(cfg, resume, interrupt, [profiling, *extras])  # --profile-steps' profiler
        except (TrainingStopped, DataError) as e:  # alike on every rank: diverged; too little text held out
            code = 3 if isinstance(e, TrainingStopped) else 2
            if is_main:
                print(f"minipar: error: {e}", file=sys.stderr, flush=True)
            return code if is_main else after_rank0(code)
        except RankTimeout as e:  # printed by every rank that gave up: the others may be the stopped ones
            print(f"minipar: error: {e}", file=sys.stderr)
            return 4
        finally:
            if is_main:  # killed instead (torchrun restarting us)? The next rank 0 takes the stale lock over
                run_folder.unlock(cfg.out)


def launch_watched(cfg: TrainConfig, resume: Path | None, interrupt: Interrupt, extras: Sequence) -> int:
    """The process group (a rank that never comes is named within --timeout), then the run
    (launch.launch); a rank that stops answering becomes a RankTimeout naming what it waited for."""
    device, watch = start_distributed(cfg.timeout), HangWatch()
    try:
        return launch(cfg, resume, device, interrupt, extras, watch=lambda mesh: watch.listen(mesh.ledger))
    except RuntimeError as e:  # DistBackendError too: a rank stopped answering or died? name what we waited for
        if not stopped_answering(e):
            raise
        raise RankTimeout(hang_report(cfg.timeout, watch, e)) from None


def check_extras(cfg: TrainConfig, extras: Sequence) -> None:
    """Each plug-in's checks; replica groups need theirs (the run has no fault tolerance of its own)."""
    if cfg.replica_groups > 1 and not extras:
        raise ConfigError(f"--replica-groups {cfg.replica_groups} needs the replica groups' plug-in "
                          "(minipar/extras/replicas.py): run scripts/train.py, which hands it over")
    for extra in extras:
        extra.check(cfg)


def printed_only(cfg: TrainConfig) -> bool:
    """--plan (what each rank will hold) or --print-config (a --config file of this run): printed, the
    run's only work."""
    if cfg.print_config:
        print(config_file_text(cfg), end="")
    elif cfg.plan:
        print(report(cfg))
    return cfg.plan or cfg.print_config


def check_paths(cfg: TrainConfig, lock: bool = True) -> Path | None:
    """File-system checks, before any process group: data, the checkpoint to resume, --out. Then
    rank 0 locks --out for the run (and clears what an interrupted save left there), if `lock`."""
    find_files(cfg.data)  # raises DataError when missing
    source = cfg.resume
    if cfg.resume == "auto":  # self-resume (torchrun --max-restarts): --out's newest checkpoint, if any yet
        if cfg.out is None:
            raise ConfigError("--resume auto needs --out: the folder the run saves to and continues from")
        source = cfg.out if checkpoint.checkpoints(cfg.out) else None
    skipped, corrupt = [], []
    resume = run_folder.resolve(source, skipped, corrupt=corrupt) if source else None
    if cfg.out is None:  # continue where we resume, else a fresh numbered folder, the same on every rank
        cfg.out = str(resume.parent) if resume else new_run_folder(cfg.timeout)
    if cfg.init_from:  # weights to start from: a checkpoint folder, or the newest in an --out folder
        cfg.init_from = str(run_folder.resolve(cfg.init_from, flag="--init-from"))
    saved_id = run_folder.run_id(cfg.out)  # a run_id not of minipar's form: refused here, never replaced
    kept = saved_id if cfg.resume else None  # a resumed run keeps its id (and its JSON log)
    check_files(cfg, resume, kept)  # the data is text, --out and the logs writable, the checkpoint of this run
    # Newer checkpoints of --out that do not verify are set aside (below), not in the way of this run's saves.
    ours = [p for p in corrupt if p.parent.resolve() == Path(cfg.out).expanduser().resolve()]
    start = json.loads((resume / "train_state.json").read_text())["step"] if resume else 0
    log = Path(cfg.log_json).expanduser().resolve() if cfg.log_json else None  # this run's log may live in --out
    foreign = [n for n in run_folder.not_a_runs(cfg.out) if Path(cfg.out).expanduser().resolve() / n != log]
    if foreign:  # a user's folder (a model, a home): a run never mixes its files into it
        raise ConfigError(f"--out {cfg.out} holds files that are not a minipar run's ({', '.join(foreign[:3])}"
                          f"{' ...' if len(foreign) > 3 else ''}): give a new or empty folder")
    later = [p.name for p in checkpoint.checkpoints(cfg.out)
             if int(p.name[5:]) > start and p.name not in {q.name for q in ours}]
    if later:  # this run would save over them: refuse, whether they are another run's or this one's future
        raise ConfigError(
            f"--out {cfg.out} already holds checkpoints {f'after {resume}' if resume else 'of an earlier run'} "
            f"({later[0]}{f' ... {later[-1]}' if len(later) > 1 else ''}): continue the newest with --resume "
            f"{cfg.out}, or choose another --out (nothing is overwritten)")
    profile_note = check_profiled_steps(cfg, start) if cfg.profile_steps else None
    if lock and os.environ.get("RANK", "0") == "0":
        notes = run_folder.lock(cfg.out)  # first: only the holder of --out moves anything in it
        run_folder.name_run(cfg.out, kept)
        for folder, why in zip(corrupt, skipped):  # --out's own set aside by name (unless an earlier attempt did)
            moved = run_folder.set_aside(folder).name if folder in ours and folder.exists() else None
            notes.append(f"{why.split(';')[0]}: moved it aside to {moved}, resuming from an earlier one" if moved
                         else f"skipped {why}")
        notes += [profile_note] if profile_note else []
        for note in notes:
            print(f"minipar: {note}", flush=True)
    return resume


def new_run_folder(timeout: float) -> str:
    """runs/run_NNN, the first unused number. Every rank must save to the same one: under torchrun
    rank 0 chooses it and tells the others through the store torchrun's agent serves its workers
    (MASTER_ADDR:MASTER_PORT), before any process group exists. (scripts/train.py --nproc-per-node
    chooses it itself and passes --out to every worker.)"""
    def first_unused() -> str:
        return next(f"runs/run_{i:03d}" for i in range(1, 10**4) if not Path(f"runs/run_{i:03d}").exists())
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process chooses
        return first_unused()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # no store to ask before the process group
        raise ConfigError("several ranks need one --out to save to, and without torchrun's shared store (or under "
                          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) they cannot agree on a new runs/run_NNN: give --out")
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    key = (f"minipar/{os.environ.get('TORCHELASTIC_RUN_ID')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
           f"/out")  # this attempt's: the store may outlive it
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        if os.environ["RANK"] == "0":
            store.set(key, first_unused())
        return store.get(key).decode()  # rank 0 reads its own choice back
    except RuntimeError as e:  # DistStoreError: timed out; DistNetworkError: no store there
        raise ConfigError(f"the ranks could not agree on a new run folder through torchrun's store at {where} "
                          f"within --timeout {timeout:g} s ({str(e).splitlines()[0][:120]}): give --out") from None


def check_profiled_steps(cfg: TrainConfig, start: int) -> str | None:
    """--profile-steps must name steps this run takes (a resumed run starts after `start`), and its
    traces need a new folder they can be written in (profiling.traces_in_the_way). A restart of
    --resume auto drops the flag instead and returns the note that says so: the attempt before it
    profiled those steps, or never reached them (folder new)."""
    why = profiling.traces_in_the_way(cfg)
    if cfg.profiled()[0] <= start:
        why = f"this run resumes after step {start}: give steps it runs, from {start + 1}"
    if why is None:
        return None
    if cfg.resume != "auto":
        raise ConfigError(f"--profile-steps {cfg.profile_steps}: {why}")
    note = f"this restart profiles nothing (--profile-steps {cfg.profile_steps}: {why.split(': ')[0]})"
    cfg.profile_steps = None
    return note


def after_rank0(code: int) -> int:
    """Rank 0 prints this error: exiting first gets it SIGTERMed by torchrun before its line is out."""
    time.sleep(30.0)  # torchrun ends this rank once rank 0 has exited; bounded, if rank 0 is elsewhere
    return code


def start_workers(agent: list[str], argv: list[str], extras: Sequence = ()) -> int:
    """Check the run's command line once, here, as `main` does before any process group (memory,
    files: not --out's lock, which rank 0 of the workers takes); a mistake is one line and exit 2,
    and no worker starts. Then run torchrun's elastic agent in this process: it starts the workers
    (this same script, with the run's flags) and restarts them (--max-restarts). Quietly: the agent's
    own warnings (the OMP banner, "shutting down workers" on Ctrl-C) would bury the run's lines."""
    with Interrupt():  # Ctrl-C while checking (tokenising the data can take minutes): one line, exit 130
        try:
            workers_argv = checked_for_workers(agent, argv, extras)
        except ValueError as e:
            print(f"minipar: error: {e}", file=sys.stderr, flush=True)
            return 2
    if workers_argv is None:
        return 0  # --plan, --print-config: printed
    os.environ.setdefault("MINIPAR_COMMAND", json.dumps(sys.argv))  # the stop line's command (interrupt.rerun_command)
    return run_agent(agent, workers_argv)


def checked_for_workers(agent: list[str], argv: list[str], extras: Sequence = ()) -> list[str] | None:
    """The run's command line for the workers, checked as `main` checks it (ValueError: one line),
    or None once --plan or --print-config is printed. Without --out, the folder this process chose is added."""
    from torch.distributed import run as torchrun
    try:
        opts = agent_options(agent)
        nodes = torchrun.parse_min_max_nnodes(opts.nnodes)[1]  # "1:1" unless --nnodes N
        os.environ["WORLD_SIZE"] = str(int(opts.nproc_per_node) * nodes)  # the world the layout must fill
        cfg = parse_args(argv)
        if printed_only(cfg):
            return None
        check_memory(cfg)
        out = cfg.out
        check_extras(cfg, extras)  # before any worker: a lighthouse that is not there, they would each wait for
        check_paths(cfg, lock=False)
        if int(opts.nproc_per_node) > 1:  # torchrun's own choice for several workers, said without its banner
            os.environ.setdefault("OMP_NUM_THREADS", "1")
    finally:
        os.environ.pop("WORLD_SIZE", None)
    # the workers save where this process chose: a fresh numbered folder, or the resumed one's
    return argv if out is not None else [*argv, f"--out={cfg.out}"]


def check_rendezvous() -> None:
    """Restarts (torchrun --max-restarts) need a rendezvous whose store is made anew for each
    attempt. torchrun's static rendezvous (--master-port without --rdzv-backend) keeps one store
    for every attempt, as c10d does unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted rank
    may then read the dead attempt's keys and wait on them (seen: a gloo connect refused, and a
    hang of 15 minutes in init_process_group). torchrun tells its workers which kind they have:
    TORCHELASTIC_USE_AGENT_STORE is True for those two, and only for them."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        static = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"  # c10d honours it; static does not
        raise ConfigError(f"torchrun --max-restarts {os.environ['TORCHELASTIC_MAX_RESTARTS']} with "
                          + ("its static rendezvous (--master-port): drop --master-port and use --standalone, or "
                             "--rdzv-backend c10d --rdzv-endpoint HOST:PORT" if static else
                             "a rendezvous store shared across restarts: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
                          + " (a restart could wait on the dead attempt's addresses; see the README)")


def exit_with_parent() -> None:
    """Under torchrun, ask Linux to SIGTERM this worker when torchrun dies, even by kill -9: no
    orphaned worker trains on alone, holding its GPU and --out's lock."""
    if sys.platform == "linux" and "TORCHELASTIC_RUN_ID" in os.environ:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
