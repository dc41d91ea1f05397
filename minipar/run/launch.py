"""The run's start, its process group begun (ops/hang.start_distributed: NCCL on GPUs, gloo on
CPU): its mesh, the run log and the data (load_data: tokenised once a machine), then the loop
(train.run). ops/cli.py checks everything before it and calls `launch`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
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
from minipar.run.run_log import RunLog, memory_baseline
from minipar.run.validation import validation_batches


def launch(cfg: TrainConfig, resume: Path | None, device: torch.device, interrupt=None,
           extras: Sequence = (), watch: Callable[[Mesh], None] | None = None) -> int:
    """This rank's part of the run: the mesh (shown to `watch`, ops/hang's listener, first), the log
    and the data; then the loop (train.run), with the step hooks of the plug-ins (`extras`) that
    add some. Returns the exit code: 0, or 130 if Ctrl-C stopped the steps (a torchrun worker's: 0)."""
    torch.manual_seed(cfg.seed)
    mesh = Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, timeout=cfg.timeout,
                      ranks_per_node=cfg.ranks_per_node)
    if watch is not None:
        watch(mesh)
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
    stopped = train.run(cfg, resume, mesh, data, log, device, lambda *built: first_hooks(extras, built))
    log.close()
    mesh.destroy()
    dist.destroy_process_group()
    return 130 if stopped and "TORCHELASTIC_RUN_ID" not in os.environ else 0


def first_hooks(extras: Sequence, built: tuple):
    """Each plug-in is asked (hooks_for(cfg, mesh, wrapper, log)); at most one adds step hooks."""
    hooks = [h for extra in extras if (h := extra.hooks_for(*built)) is not None]
    assert len(hooks) <= 1, "two plug-ins add step hooks: the loop takes one set"
    return hooks[0] if hooks else None


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
