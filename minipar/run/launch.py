"""The run's start: this rank's process group, its mesh, the run log and the data, then the loop
(train.run). ops/cli.py checks everything before it and calls `launch`.

    launch              the process group (start_distributed: NCCL on GPUs, gloo on CPU; a rank
                        that never comes is named within --timeout), the mesh, the log, the
                        data (load_data: tokenised once a machine), then train.run; a rank that
                        stops answering becomes a RankTimeout naming what it waited for
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from minipar import zeropp
from minipar.collectives import Group, all_reduce
from minipar.mesh import Mesh
from minipar.run import train
from minipar.run.batches import TokenData
from minipar.run.config import TrainConfig, effective
from minipar.run.data import DataError, prepare
from minipar.run.hang import HangWatch, RankTimeout, hang_report, stopped_answering
from minipar.run.run_log import RunLog, memory_baseline
from minipar.run.saving import Interrupt
from minipar.run.validation import validation_batches


def launch(cfg: TrainConfig, resume: Path | None, interrupt: Interrupt | None = None, extras: Sequence = ()) -> int:
    """This rank's part of the run: the process group, the mesh, the log and the data; then the
    loop (train.run). A rank that stops answering becomes a RankTimeout naming what we waited for.
    Returns the exit code: 0, or 130 if Ctrl-C stopped the steps (a torchrun worker's: 0)."""
    device = start_distributed(cfg.timeout)
    torch.manual_seed(cfg.seed)
    mesh = Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, timeout=cfg.timeout,
                      ranks_per_node=cfg.ranks_per_node)
    watch = HangWatch(mesh.ledger)
    if cfg.ep > 1:  # experts: the dp x cp ranks reshaped to edp x ep
        mesh.unflatten(("dp", "cp"), edp=cfg.dp * cfg.cp // cfg.ep, ep=cfg.ep)
    if cfg.zeropp and set(zeropp.SPLIT) & set(zeropp.parse(cfg.zeropp)):  # ZeRO++: dp = dp_cross x dp_intra
        zeropp.split_dp_by_node(mesh)
    log = RunLog(cfg, mesh, device, interrupt)
    log.say(effective(cfg))
    log.say(mesh.layout.table())
    if cfg.ep > 1:
        log.say(f"experts: the dp x cp ranks as edp {cfg.dp * cfg.cp // cfg.ep} x ep {cfg.ep}; this rank's ep group "
                f"{mesh.group('ep').ranks}, edp group {mesh.group('edp').ranks}")
    data = load_data(cfg, resume, log.group)
    log.memory_base = memory_baseline(device)  # the run's own memory: not the tokenizer's peak
    try:
        stopped = train.run(cfg, resume, mesh, data, log, device, lambda *built: next(  # the first plug-in's
            (hooks for extra in extras if (hooks := extra.hooks_for(*built)) is not None), None))
    except RuntimeError as e:  # DistBackendError too: a rank stopped answering or died? name what we waited for
        if not stopped_answering(e):
            raise
        raise RankTimeout(hang_report(cfg.timeout, watch, e)) from None
    log.close()
    mesh.destroy()
    dist.destroy_process_group()
    return 130 if stopped and "TORCHELASTIC_RUN_ID" not in os.environ else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_distributed(timeout: float | None = None) -> torch.device:
    """NCCL on GPUs, gloo on CPU. Without torchrun, a world of one. timeout: seconds (None: torch's).
    Under torchrun, a rank that does not come is named within the timeout (`join`)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    limit = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    if "RANK" in os.environ:
        if backend == "nccl":  # one GPU per local rank (ranks beyond the GPU count share them)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        join(lambda: dist.init_process_group(backend, **limit), timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, **limit)
        if backend == "nccl":
            torch.cuda.set_device(0)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def join(start, timeout: float | None) -> None:
    """Run `start` (init_process_group), which waits at the rendezvous for every rank. Past
    --timeout it is a RankTimeout naming the rendezvous; should it wait on regardless (a store
    connection retried, gloo's mesh), a watchdog says the same line and ends the process."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "?")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    limit = "none" if timeout is None else f"{timeout:g} s"  # None: wait as long as torch does (benchmarks)
    line = (f"rank {rank}: the process group did not start within --timeout {limit}: the {world} ranks did "
            f"not all reach the rendezvous at {where} (a rank did not start, died, or has another --master-port)")
    done = threading.Event()

    def watchdog():
        if not done.wait(timeout + 15):
            print(f"minipar: error: {line}", file=sys.stderr, flush=True)
            os._exit(4)
    if timeout is not None:
        threading.Thread(target=watchdog, daemon=True).start()
    try:
        start()
    except (RuntimeError, ValueError) as e:  # DistStoreError, DistNetworkError: timed out or refused
        raise RankTimeout(f"{line} ({str(e).splitlines()[0][:160]})") from None
    finally:
        done.set()


def load_data(cfg: TrainConfig, resume: Path | None, group: Group) -> TokenData:
    """Tokenised once per machine (local rank 0); the other ranks (`group`: all) wait and read the cache. The
    tokenizer: --tokenizer, else a resumed checkpoint's (the same ids, even if the cache is gone),
    else a BPE trained on the data."""
    saved = resume / "tokenizer.json" if resume is not None and (resume / "tokenizer.json").exists() else None
    args: tuple = (cfg.data, cfg.bpe_vocab, cfg.cache_dir, cfg.tokenizer or saved, cfg.token_dtype)
    failure = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        try:
            prepare(*args)
        except DataError as e:  # a full cache disk, a tokenizer that fails: nothing half-written is left
            failure = e
    failed = torch.tensor([float(failure is not None)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    all_reduce(failed, group, op="max")  # the barrier: the others wait, and learn whether it worked
    if failure is not None or failed.item():
        raise failure or DataError("the data could not be prepared on another node (its rank 0 says why)")
    data = TokenData(prepare(*args), cfg.seq_len, cfg.seed, cfg.val_fraction)
    validation_batches(cfg, data)  # raises DataError when too little is held out
    return data
