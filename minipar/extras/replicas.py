"""Replica groups: data parallelism that survives a lost replica, on torchft (chapter 10b).

A run of R replica groups is R torchrun jobs, each with the whole layout inside; across them only
the step's gradient average travels. A group that dies is dropped and, back, takes a live peer's
state. torchft provides the lighthouse (where the groups form each step's quorum), a Manager per
rank (the cross-group process group, the heal of a group behind) and the commit vote; this file
plugs them into the loop's step hooks (run/step.py; scripts/train.py hands it to cli.main):

    begin       the quorum; a group behind takes the most advanced peer's step, samples and state;
                the groups must then agree on step, samples and (on a new quorum) settings and
                a weights digest, or the run stops in one line
    rows        the global batch is R x dp slots; the P groups taking part share all R groups'
    outer_sum   the loss divisor's target count summed over the P groups
    gate        each gradient (or ZeRO slice) averaged over the P groups, then the vote: yes,
                clip and step; no, the gradients are dropped and the same step is taken again

So a step's loss is the token mean over the same global batch whether 1 or R groups took part,
and a lost group costs the survivors time, not samples; nothing is read from disk.
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import http.server
import logging
import os
import re
import socket
import time
from dataclasses import fields

import torch
import torch.distributed as dist

from minipar.collectives import Group, all_reduce, broadcast
from minipar.data_parallel import GradSync
from minipar.mesh import Mesh
from minipar.run.batches import TokenData
from minipar.run.config import ConfigError, TrainConfig
from minipar.run.run_log import RunLog
from minipar.run.saving import TrainingStopped
from minipar.run.step import StepHooks
from minipar.zero import ZeroDataParallel


# -- the plug-in: what launch.main asks of this module (scripts/train.py hands it over) ------------
def check(cfg: TrainConfig) -> None:
    """Before any process group: the settings (`check_settings`), then a lighthouse must answer at
    --lighthouse (one line if not)."""
    check_settings(cfg)
    if cfg.replica_groups > 1:
        check_lighthouse(cfg.lighthouse, cfg.timeout)


def check_settings(cfg: TrainConfig) -> None:
    """A lighthouse to meet at, its address well-formed, and a batch every group can share."""
    r = cfg.replica_groups
    if r > 1 and not cfg.lighthouse:
        raise ConfigError(f"--replica-groups {r} needs --lighthouse HOST:PORT, where torchft's lighthouse runs "
                          "(scripts/train_ft.py starts one)")
    if r > 1 and cfg.global_batch % (r * cfg.dp * cfg.micro_batch):
        raise ConfigError(f"--global-batch {cfg.global_batch} is not divisible by --replica-groups {r} x --dp "
                          f"{cfg.dp} x --micro-batch {cfg.micro_batch}: every group's ranks take whole "
                          f"micro-batches of it")
    if r > 1:
        lighthouse_address(cfg.lighthouse)


def lighthouse_address(text: str) -> tuple[str, int]:
    """--lighthouse as (host, port): HOST:PORT, or http://HOST:PORT as torchft writes it; the host a
    name, an IPv4 address or an [IPv6] one. Anything else is refused here, before any process group,
    not found by torchft's connect attempt after --timeout."""
    found = re.fullmatch(r"(?:http://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})/?", text)
    if found is None or not 1 <= int(found[2]) <= 65535:
        raise ConfigError(f"--lighthouse {text!r}: give HOST:PORT (e.g. localhost:29510, torchft_lighthouse's "
                          f"default), the port 1 to 65535, at most one http:// before it and no spaces")
    return found[1], int(found[2])


def hooks_for(cfg: TrainConfig, mesh: Mesh, model: GradSync, log: RunLog) -> StepHooks | None:
    """The step hooks of this rank's seat among the replica groups, once the model is built."""
    return Replicas(cfg, mesh, model, log) if cfg.replica_groups > 1 else None


def persistent(model: GradSync) -> list[torch.Tensor]:
    """Every tensor a rank keeps from step to step but the optimizer's state, in a fixed order: what
    a returning group takes (with the optimizer's state_dict). Read off the wrapper's public state:
    its module's weights (ZeRO-3: only buffers, its weights are the shards) and masters (bf16-mixed's
    fp32 copies; ZeRO's slices, and whatever else each bucket holds)."""
    if not isinstance(model, ZeroDataParallel):  # DataParallel: its masters are the weights unless bf16-mixed
        masters = [m for p, m in getattr(model, "master", {}).items() if m is not p]
        return [*model.module.state_dict().values(), *masters]
    weights = model.module.buffers() if model.stage == 3 else model.module.state_dict().values()
    return [*weights, *(t for b in model.buckets for t in b.held())]


def lost_gpu_hours(gpus: int, gpu_mtbf_hours: float, hours: float, restart_hours: float,
                   checkpoint_every_hours: float = 0.0, group_gpus: int | None = None) -> float:
    """The GPU-hours a run of `hours` on `gpus` expects to lose to failures, each GPU failing once
    per `gpu_mtbf_hours` on average: gpus x hours / gpu_mtbf_hours failures. Checkpoint-restart
    (group_gpus None): each stops every GPU for the restart and throws away the work since the last
    save, half an interval on average: gpus x (restart + interval / 2) each. Replica groups of
    `group_gpus`: only the failed GPU's group stops, for its restart; the others train on and lose
    the stall until the failure shows (up to torchft's timeout) and the step in flight, which every GPU
    redoes: left out here, scripts/train_ft.py --costs adds them. group_gpus x restart each."""
    failures = gpus * hours / gpu_mtbf_hours
    if group_gpus is None:
        return failures * gpus * (restart_hours + checkpoint_every_hours / 2)
    return failures * group_gpus * restart_hours


# Settings that say only where a group writes, logs, resumes from or how long it waits: each group
# may have its own (the weights a group starts from are compared by digest). Every other setting
# changes the math or the batch, and the groups must share it (Replicas.agree).
OWN_SETTINGS = {"replica_group_id", "out", "log_json", "log_every", "wandb", "resume", "init_from", "save_every",
                "save_on_interrupt", "timeout", "profile_steps", "plan", "config", "cache_dir", "lighthouse",
                "allow_config_change", "eval_every", "eval_batches", "max_bad_steps", "ranks_per_node", "print_config"}
SAME_START = ("start every group from the same checkpoint (or, all but one, from none: a new group takes the "
              "others' state)")


def shared_settings(cfg: TrainConfig) -> dict[str, int]:
    """Each setting the groups must share, as 60 bits of SHA-256 of its value: an exact int64."""
    return {f.name: int(hashlib.sha256(repr(getattr(cfg, f.name)).encode()).hexdigest()[:15], 16)
            for f in fields(cfg) if f.name not in OWN_SETTINGS}


def _leader(where: torch.Tensor) -> int:
    """The row of the most advanced group: the highest step, then the lowest group id."""
    return max(range(len(where)), key=lambda i: (int(where[i, 1]), -int(where[i, 0])))


def disagreement(where: torch.Tensor, state: torch.Tensor | None, names: list[str]) -> str | None:
    """What the groups' rows (Replicas.agree) disagree on, against the most advanced group's, in one
    line; None if nothing. Weights are the caller's: each rank compares its own shards."""
    lead, rows = _leader(where), where.tolist()
    group, first = (lambda i: rows[i][0]), rows[lead][0]
    if state is not None:
        differ = {group(i): [f"--{n.replace('_', '-')}" for k, n in enumerate(names) if state[i, 1 + k] !=
                             state[lead, 1 + k]] for i in range(len(rows))}
        if any(differ.values()):
            return (f"replica groups disagree on their settings, against group {first}'s: " + "; ".join(
                f"group {g}'s {', '.join(d)}" for g, d in differ.items() if d) + "; give every group the same "
                "flags (each has its own --replica-group-id, --out, --log-json, --resume)")
    apart = [i for i, r in enumerate(rows) if r[1:3] != rows[lead][1:3]]
    if apart:  # the heal brings a group behind level: this one was not (a state that did not fit)
        return ("replica groups are not at one step of one run: " + ", ".join(
            f"group {group(i)} at step {rows[i][1]}, {rows[i][2]} samples in" for i in [lead, *apart]) +
            f"; {SAME_START}")
    return None


def lighthouse_url(address: str) -> str:
    """--lighthouse (checked by config.lighthouse_address) as torchft takes it: http://HOST:PORT."""
    host, port = lighthouse_address(address)
    return f"http://{host}:{port}"


def check_lighthouse(address: str, timeout: float) -> None:
    """Ask the lighthouse for its dashboard (plain HTTP, on the port it serves torchft's gRPC on),
    waiting at most `timeout` seconds, before any process group: torchft's own client would wait as
    long for a closed port as for a slow lighthouse, answer another server with a traceback, and hold
    the connect where no one can see it. Python's socket calls let Ctrl-C's handler run meanwhile.
    ConfigError says what answered, if not a lighthouse."""
    host, port = lighthouse_address(address)
    try:
        connection = http.client.HTTPConnection(host.strip("[]"), port, timeout=timeout)
        try:
            connection.request("GET", "/")
            page = connection.getresponse().read(1 << 16)
        finally:
            connection.close()
    except ConnectionRefusedError:
        found = "connection refused: nothing listens there (start the lighthouse first, or give its port)"
    except socket.gaierror:
        found = f"no such host: {host} does not resolve"
    except TimeoutError:
        found = (f"no answer within --timeout {timeout:g} s (something accepted the connection and said "
                 f"nothing, or the host drops it)")
    except (OSError, http.client.HTTPException) as e:
        found = f"not a lighthouse: {type(e).__name__} ({str(e)[:80] or 'no reply'})"
    else:
        if b"torchft" in page and b"Lighthouse" in page:
            return
        found = "not a lighthouse: an HTTP server answered whose page is not torchft's lighthouse dashboard"
    raise ConfigError(f"--lighthouse {address}: {found}")


class Replicas(StepHooks):
    """This rank's seat among the replica groups: its torchft Manager, the step's participants, and
    the loop's step hooks (begin, rows, outer_sum, loss, gate, close)."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, model: GradSync, log: RunLog):
        os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust half logs each quorum at INFO; read at import
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        logging.getLogger("torchft").setLevel(logging.ERROR)  # its per-step INFO lines; our log says what happened
        # torchft's HTTP server prints a line per download of a peer's state; our log says it once
        http.server.BaseHTTPRequestHandler.log_message = lambda *a: None  # type: ignore[method-assign]

        self.id, self.groups, self.model, self.mesh = cfg.replica_group_id, cfg.replica_groups, model, mesh
        self.log, self.say = log, log.say
        self.group = Group("world", dist.group.WORLD, list(range(dist.get_world_size())), mesh.ledger)  # its ranks
        self.settings, self.quorum, self.agreed = shared_settings(cfg), None, False  # what agree() compares
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # of torchft's process group
        self.step, self.consumed = 0, 0
        self.taken: tuple[int, int, int, int] | None = None  # (peer group, step, samples, bytes) a heal took
        self.size, self.index = 0, 0  # groups taking part in this step, and our place among them
        self.timeout, timeout = cfg.timeout, datetime.timedelta(seconds=cfg.timeout)
        pg = (ProcessGroupNCCL if torch.cuda.is_available() else ProcessGroupGloo)(timeout=timeout)
        host, port = self._group_store()
        self.manager = Manager(pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=1,
                               use_async_quorum=False, init_sync=False, replica_id=f"minipar_{self.id:03d}",
                               lighthouse_addr=lighthouse_url(cfg.lighthouse), rank=dist.get_rank(),
                               world_size=dist.get_world_size(), store_addr=host, store_port=port, timeout=timeout,
                               quorum_timeout=timeout, connect_timeout=timeout)
        self.say(f"replica group {self.id} of {self.groups}: each rank averages its gradients with the same rank of "
                 f"the other groups, through torchft (lighthouse {cfg.lighthouse}); the global batch is "
                 f"{self.groups} x dp {cfg.dp} slots of {cfg.global_batch // (self.groups * cfg.dp)} rows")

    def _group_store(self) -> tuple[str, int]:
        """A key-value store for this group's Managers (torchft's rendezvous), served by our rank 0:
        its host name and port, told to every rank of the group. (torchrun's own store is no use
        here: its workers know it as localhost, and the other groups must reach it.)"""
        where = torch.zeros(2 + 255, dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        if dist.get_rank() == 0:  # [port, length of the name, its bytes]
            self._store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
            host = list(socket.gethostname().encode())
            where[:2 + len(host)] = torch.tensor([self._store.port, len(host), *host])
        broadcast(where, self.group)
        return bytes(where[2:2 + int(where[1])].tolist()).decode(), int(where[0])

    # -- a step ---------------------------------------------------------------------------------
    def begin(self, step: int, consumed: int) -> tuple[int, int]:
        """The quorum for the next step, and the groups' agreement (`agree`). Returns (step, samples
        consumed): ours, or, if this group was behind, the peer's whose state it just took."""
        self.step, self.consumed, self.taken = step, consumed, None
        # torchft heals by its own step count: make it ours, so that a group resumed from an older
        # checkpoint, or a new one, is seen to be behind and takes the state of the most advanced
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        self.manager.start_quorum()
        if self.size == 0 and self.taken is None:  # a group's first step waits for every group, when it can
            until = time.monotonic() + self.timeout
            while self.manager.num_participants() < self.groups and time.monotonic() < until:
                time.sleep(0.1)
                self.manager.start_quorum()
        if self.taken is not None:
            peer, self.step, self.consumed, nbytes = self.taken
            self.say(f"step {self.step + 1}: replica group {self.id} took its state from group {peer}: step "
                     f"{self.step}, {nbytes:,} bytes, nothing read from disk")
        before, self.size = self.size, self.manager.num_participants()
        self.index = self.manager.participating_rank() or 0
        self.agree()
        if self.size != before:
            self.say(f"step {self.step + 1}: {self.size} of {self.groups} replica groups take part")
        self.log.extra["replica_groups"] = self.size  # in each step's record: how many groups took part
        return self.step, self.consumed

    def agree(self) -> None:
        """Before any gradient is averaged, the groups taking part must be at one step with one count
        of samples (checked each step), and share their settings and weights (checked when the quorum
        is new or a group took state: the weights' digest is not free). Each table below has a row per
        group: each group fills its own, and the sum over the groups is every row, exactly (int64).
        A group that differs stops the run, every group of it, in one line naming what differs."""
        quorum = self.manager._quorum_id  # torchft keeps it private; it changes whenever the groups do
        fresh = quorum != self.quorum or self.taken is not None or not self.agreed
        self.quorum = quorum
        where = self._rows([self.id, self.step, self.consumed, int(fresh)])  # [group, step, samples, fresh]
        state = None
        if where is not None and where[:, 3].any():  # [weights digest, each shared setting's hash]
            state = self._rows([int(digest(persistent(self.model), self.model.optimizer.state_dict())[:15], 16),
                                *self.settings.values()])
        vote = torch.zeros(1 + self.size, dtype=torch.int64, device=self.device)  # [incomplete, weights differ]
        problem = None
        if where is None or where[:, 3].any() and state is None:  # a group was lost meanwhile: next step, again
            vote[0] = 1
        else:
            problem = disagreement(where, state, list(self.settings))
            if state is not None:  # each rank holds its own shards: a difference on any rank counts
                vote[1:] = state[:, 0] != state[_leader(where), 0]
        if dist.get_world_size() > 1:  # every rank of this group decides alike
            all_reduce(vote, self.group, op="max")
        self.agreed = not vote[0]
        if self.agreed and (problem or vote[1:].any()):
            lead, others = _leader(where), [int(g) for g, d in zip(where[:, 0], vote[1:]) if d]
            raise TrainingStopped(problem or f"replica groups hold different weights at the same step "
                                  f"{int(where[lead, 1])}, against group {int(where[lead, 0])}'s: "
                                  f"{', '.join(f'group {g}' for g in others)} (a digest of weights and optimizer "
                                  f"state); they continue different runs; {SAME_START}")

    def _rows(self, row: list[int]) -> torch.Tensor | None:
        """Every participating group's `row`, in quorum order: a table of zeros with ours in our row,
        summed over the groups (an all-gather through torchft's all-reduce). None if that failed."""
        table = torch.zeros(self.size, len(row), dtype=torch.int64, device=self.device)
        table[self.index] = torch.tensor(row, dtype=torch.int64)
        self.sum(table)
        return None if self.manager.errored() else table.cpu()

    def rows(self, data: TokenData, consumed: int, global_batch: int, dp: int, coord: int):
        """This rank's rows: the slots of the groups whose share this group takes (module docstring)."""
        slots = [j * dp + coord for j in range(self.groups) if j % self.size == self.index]
        parts = [data.rank_batch(consumed, global_batch, s, self.groups * dp) for s in slots]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the groups taking part (in place)."""
        return self._reduce(t, dist.ReduceOp.SUM)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.AVG)

    def outer_sum(self, t: torch.Tensor) -> int:
        """The step's target count summed over the groups taking part: the batch is cut into as many."""
        self.sum(t)
        return self.size

    def loss(self, total):
        return self.mean(torch.as_tensor(total, dtype=torch.float64).reshape(1))  # the groups' mean

    def gate(self, grads: list[torch.Tensor]) -> bool:
        """The commit (GradSync.clip_and_step asks, with this rank's synced gradients or ZeRO slices):
        average them over the groups, then vote; True if every rank of every group may step."""
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = self.mean(torch.cat([g.reshape(-1) for g in same]))  # one message per dtype
            for g, v in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(v.view_as(g))
        committed = self.manager.should_commit()
        if not committed:  # no weight changed: the loop takes the same step again
            self.say(f"step {self.step + 1}: not committed (a replica group was lost during it): taken again")
        return committed

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        sent = 2 * (self.size - 1) * t.nbytes // max(self.size, 1)  # a ring all-reduce's, per rank
        self.mesh.ledger.record("replicas", "all_reduce", t.nbytes, sent, cross=sent)  # groups: their own nodes
        self.manager.allreduce(t, reduce_op=op).wait()  # after an error: nothing, and the vote will say no
        return t

    # -- the state a returning group takes from a peer (torchft calls these) --------------------
    def _state(self) -> dict:
        """What rank r of a returning group takes from our rank r: served by torchft's HTTP transport
        from these very tensors (they change only at the optimizer step, which waits for the download)."""
        tensors, optimizer = persistent(self.model), self.model.optimizer.state_dict()
        nbytes = _nbytes(tensors, optimizer)
        self.mesh.ledger.record("replicas", "send_state", nbytes, nbytes, cross=nbytes)
        self.say(f"step {self.step + 1}: replica group {self.id} sends its state to a returning group: "
                 f"{nbytes:,} bytes, digest {digest(tensors, optimizer)}")
        return {"group": self.id, "step": self.step, "consumed": self.consumed, "tensors": tensors,
                "optimizer": optimizer}

    def _load(self, state: dict) -> None:
        mine, nbytes = persistent(self.model), _nbytes(state["tensors"], state["optimizer"])
        if [t.shape for t in mine] != [t.shape for t in state["tensors"]]:
            return  # another model or layout: nothing applied, and agree() names the setting that differs
        self.say(f"step {state['step'] + 1}: replica group {self.id} is applying a peer's state ({nbytes:,} bytes)")
        with torch.no_grad():
            for t, theirs in zip(mine, state["tensors"]):
                t.copy_(theirs)
        # scripts/train_ft.py --kill-in-transfer: wait here, half-applied, to be killed (its restart heals anyway)
        time.sleep(float(os.environ.get("MINIPAR_FT_PAUSE_IN_TRANSFER", 0)))
        self.model.optimizer.load_state_dict(state["optimizer"])
        self.mesh.ledger.record("replicas", "recv_state", nbytes, 0)
        self.taken = (state["group"], state["step"], state["consumed"], nbytes)
        self.say(f"step {state['step'] + 1}: replica group {self.id} applied it: digest "
                 f"{digest(mine, self.model.optimizer.state_dict())}")

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def digest(tensors: list[torch.Tensor], optimizer: dict) -> str:
    """16 hex digits of SHA-256 over every byte of the state, in order: equal means bitwise equal."""
    h = hashlib.sha256()
    for t in [*tensors, *(t for s in optimizer["state"].values() for t in s.values() if torch.is_tensor(t))]:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _nbytes(tensors: list[torch.Tensor], optimizer: dict) -> int:
    """Bytes of the weights, masters and optimizer state a rank sends a returning peer."""
    states = [t for s in optimizer["state"].values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.nbytes for t in [*tensors, *states])
