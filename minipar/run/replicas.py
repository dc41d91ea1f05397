"""Replica groups: data parallelism that survives a lost replica, on torchft (chapter 10b).

A run of R replica groups is R torchrun jobs, each with the whole layout inside (dp, tp, pp, cp,
ZeRO). Across the groups only one thing travels: the step's gradient average. If a group dies,
the others go on; when it comes back, it takes the live state from one of them. torchft
(PyTorch's fault-tolerance library) provides the parts, and this file wires them into the loop:

    the lighthouse       a small server every group's rank 0 heartbeats to; at each step it
                         forms the *quorum*: the groups taking part, and which of them are behind
    Manager              one per rank; start_quorum() asks the lighthouse, reconnects the
                         cross-group process group when the quorum changed (rank r of every group
                         talks to rank r of the others: the groups share one layout), and heals a
                         group that is behind: it downloads rank r's state from a peer over HTTP
    should_commit()      after backward: every rank of every group votes; the optimizer steps only
                         if all agree, so a step that lost a peer half-way changes no weights

One step, on each rank:

    step, consumed <- begin(): the quorum; a returning group takes a peer's (step, samples, state)
    rows           <- the global batch is R x dp slots of rows; the P groups taking part share
                      the R groups' slots (participant i takes every group j with j % P == i),
                      so each step still trains on the whole global batch
    divisor        <- the whole batch's targets / (dp x cp x P), the count summed across groups
    backward; finish_grad_sync (inside the group, as always)
    average        <- each gradient (or ZeRO slice) averaged over the P groups
    commit?        -> yes: clip and step, step += 1; no: drop the gradients, redo the same step

So the loss of a step is the token mean over the same global batch whether 1 or R groups took
part, and the learning-rate schedule is unchanged: a lost group costs the survivors time (they
take its micro-batches) and no samples. The step they were in when it died is not committed
and is redone. Nothing is read from disk: checkpoints are still saved as before (--save-every).
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import http.server
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from minipar.collectives import Group, broadcast
from minipar.data_parallel import GradSync
from minipar.mesh import Mesh
from minipar.run.batches import TokenData
from minipar.run.config import ConfigError, TrainConfig, lighthouse_address


def lost_gpu_hours(gpus: int, gpu_mtbf_hours: float, hours: float, restart_hours: float,
                   checkpoint_every_hours: float = 0.0, group_gpus: int | None = None) -> float:
    """The GPU-hours a run of `hours` on `gpus` expects to lose to failures, each GPU failing once
    per `gpu_mtbf_hours` on average: gpus x hours / gpu_mtbf_hours failures. Checkpoint-restart
    (group_gpus None): each stops every GPU for the restart and throws away the work since the last
    save, half an interval on average: gpus x (restart + interval / 2) each. Replica groups of
    `group_gpus`: only the failed GPU's group stops, for its restart; the others train on and lose
    only the step in flight (seconds, left out): group_gpus x restart each."""
    failures = gpus * hours / gpu_mtbf_hours
    if group_gpus is None:
        return failures * gpus * (restart_hours + checkpoint_every_hours / 2)
    return failures * group_gpus * restart_hours


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


class Replicas:
    """This rank's seat among the replica groups: its torchft Manager, and the step's participants."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, model: GradSync, say=print):
        os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust half logs each quorum at INFO; read at import
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        logging.getLogger("torchft").setLevel(logging.ERROR)  # its per-step INFO lines; our log says what happened
        # torchft's HTTP server prints a line per download of a peer's state; our log says it once
        http.server.BaseHTTPRequestHandler.log_message = lambda *a: None  # type: ignore[method-assign]

        self.id, self.groups, self.model, self.mesh = cfg.replica_group_id, cfg.replica_groups, model, mesh
        self.say = say
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
        say(f"replica group {self.id} of {self.groups}: each rank averages its gradients with the same rank of the "
            f"other groups, through torchft (lighthouse {cfg.lighthouse}); the global batch is {self.groups} x dp "
            f"{cfg.dp} slots of {cfg.global_batch // (self.groups * cfg.dp)} rows")

    def _group_store(self) -> tuple[str, int]:
        """A key-value store for this group's Managers (torchft's rendezvous), served by our rank 0:
        its host name and port, told to every rank of the group. (torchrun's own store is no use
        here: its workers know it as localhost, and the other groups must reach it.)"""
        where = torch.zeros(2 + 255, dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        if dist.get_rank() == 0:  # [port, length of the name, its bytes]
            self._store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
            host = list(socket.gethostname().encode())
            where[:2 + len(host)] = torch.tensor([self._store.port, len(host), *host])
        broadcast(where, Group("replicas", dist.group.WORLD, list(range(dist.get_world_size())), self.mesh.ledger))
        return bytes(where[2:2 + int(where[1])].tolist()).decode(), int(where[0])

    # -- a step ---------------------------------------------------------------------------------
    def begin(self, step: int, consumed: int) -> tuple[int, int]:
        """The quorum for the next step. Returns (step, samples consumed): ours, or, if this group
        was behind, the peer's whose state it just took."""
        self.step, self.consumed, self.taken = step, consumed, None
        self.manager.start_quorum()
        if step == 0 and self.size == 0 and self.taken is None:  # a new run starts with every group, when it can
            until = time.monotonic() + self.timeout
            while self.manager.num_participants() < self.groups and time.monotonic() < until:
                time.sleep(0.1)
                self.manager.start_quorum()
        if self.taken is not None:
            peer, self.step, self.consumed, nbytes = self.taken
            self.say(f"step {self.step + 1}: replica group {self.id} took its state from group {peer}: step "
                     f"{self.step}, {nbytes:,} bytes, nothing read from disk")
        size, index = self.manager.num_participants(), self.manager.participating_rank() or 0
        if size != self.size:
            self.say(f"step {self.step + 1}: {size} of {self.groups} replica groups take part")
        self.size, self.index = size, index
        return self.step, self.consumed

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

    def commit(self, grads: list[torch.Tensor]) -> bool:
        """Average the gradients over the groups, then vote: True if every rank of every group may step."""
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [g for g in grads if g.dtype == dtype]
            flat = self.mean(torch.cat([g.reshape(-1) for g in same]))  # one message per dtype
            for g, v in zip(same, flat.split([g.numel() for g in same])):
                g.copy_(v.view_as(g))
        return self.manager.should_commit()

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        sent = 2 * (self.size - 1) * t.nbytes // max(self.size, 1)  # a ring all-reduce's, per rank
        self.mesh.ledger.record("replicas", "all_reduce", t.nbytes, sent, cross=sent)  # groups: their own nodes
        self.manager.allreduce(t, reduce_op=op).wait()  # after an error: nothing, and the vote will say no
        return t

    # -- the state a returning group takes from a peer (torchft calls these) --------------------
    def _state(self) -> dict:
        """What rank r of a returning group takes from our rank r: served by torchft's HTTP transport
        from these very tensors (they change only at the optimizer step, which waits for the download)."""
        tensors, optimizer = self.model.persistent(), self.model.optimizer.state_dict()
        nbytes = _nbytes(tensors, optimizer)
        self.mesh.ledger.record("replicas", "send_state", nbytes, nbytes, cross=nbytes)
        self.say(f"step {self.step + 1}: replica group {self.id} sends its state to a returning group: "
                 f"{nbytes:,} bytes, digest {digest(tensors, optimizer)}")
        return {"group": self.id, "step": self.step, "consumed": self.consumed, "tensors": tensors,
                "optimizer": optimizer}

    def _load(self, state: dict) -> None:
        mine, nbytes = self.model.persistent(), _nbytes(state["tensors"], state["optimizer"])
        if [t.shape for t in mine] != [t.shape for t in state["tensors"]]:
            raise RuntimeError("replica groups must share one layout: a peer's state does not fit this group's")
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
