"""Run a function on N gloo ranks on CPU, as a test.

    results = run_ranks(4, my_check, arg1, arg2)     # my_check(rank, world_size, arg1, arg2)

`my_check` must live at module level in a test file (workers import it by name). Whatever it
returns comes back as results[rank]. If any rank raises, the test fails with that rank's
traceback; if the ranks do not all finish within `timeout` seconds (a hang: mismatched
collectives, a send without its recv) the test fails with a timeout message.

Starting N processes that import torch and form a process group costs seconds, so each world size
gets one pool of workers that lives for the whole pytest session and runs test after test. A pool
whose test failed or hung is killed and rebuilt, so one broken test cannot poison the next. The
workers are forked from a server process that imported torch once (multiprocessing's forkserver),
not started afresh each importing it: a pool of 8 starts in a second, not in 10 to 30 on 2 busy
cores. The server only imports torch and runs nothing, so no thread or CUDA state is copied. Its
workers see the environment and sys.path of the moment the first pool started (under spawn a
pool's did, of the moment it started): a test cannot hand workers a variable through os.environ.
"""

from __future__ import annotations

import copy
import gc
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

TIMEOUT = 120.0
MAX_THREADS = 64  # a rank holding more (groups some test still references) is replaced by a fresh one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share 2 cores; more threads only contend
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":  # tests/gpu: one GPU per rank, shared round-robin when ranks outnumber GPUs
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            outcome = (True, fn(rank, world, *args, **kwargs))
        except BaseException:  # noqa: B036 - report everything, including assertion errors
            outcome = (False, traceback.format_exc())
        _destroy_subgroups()
        results.put((rank, *outcome, _thread_count()))
    dist.destroy_process_group()


def _destroy_subgroups() -> None:
    """Free the groups a test made. Each gloo group keeps its own transport threads, which poll; a
    worker that ran hundreds of tests without this held hundreds of them, and the suite slowed
    step by step until CI's time ran out. (torch has no public list of groups: _world is private.)"""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):
        if group is not distributed_c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)
    gc.collect()  # the threads go with the last reference to a group: models and meshes hold them


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0  # Linux only


class _Pool:
    def __init__(self, world: int, backend: str = "gloo"):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])  # read when the server starts
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results, backend), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, kwargs, timeout: float):
        for q in self.tasks:
            q.put((fn, args, kwargs))
        out, failures = {}, {}
        self.threads = 0
        deadline = time.monotonic() + timeout
        while len(out) + len(failures) < self.world:
            # Once one rank failed, the others may be stuck in a collective: wait only briefly.
            if failures:
                deadline = min(deadline, time.monotonic() + 5.0)
            try:
                rank, ok, value, threads = self.results.get(timeout=1.0)
                self.threads = max(self.threads, threads)
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(out) - set(failures))
                dead = [r for r in missing if not self.procs[r].is_alive()]
                if dead and not failures:
                    raise RuntimeError(f"ranks {dead} of {self.world} died (exit codes "
                                       f"{[self.procs[r].exitcode for r in dead]})") from None
                if time.monotonic() < deadline:
                    continue
                if failures:
                    break
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s (a hang?)") from None
            (out if ok else failures)[rank] = value
        if failures:
            rank = min(failures)
            raise RuntimeError(f"rank {rank} of {self.world} failed:\n{failures[rank]}")
        return [out[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


_pools: dict[tuple[int, str], _Pool] = {}


def run_ranks(world: int, fn, *args, timeout: float = TIMEOUT, backend: str = "gloo", **kwargs):
    """Run fn(rank, world, *args, **kwargs) on `world` ranks (gloo on CPU; "nccl" for tests/gpu);
    return the per-rank results."""
    key = (world, backend)
    pool = _pools.get(key)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(kill=True)
        pool = _pools[key] = _Pool(world, backend)
    try:
        results = pool.run(fn, args, kwargs, timeout)
    except BaseException:
        pool.close(kill=True)  # ranks may be mid-collective: never reuse them
        del _pools[key]
        raise
    if pool.threads > MAX_THREADS:  # some group outlived its test (held by an object we did not find)
        pool.close()
        del _pools[key]
    return results


_recorded: dict = {}


def run_ranks_once(world: int, fn, *args, **kwargs):
    """run_ranks, once a session for each (world, fn, arguments): the tests that read other figures of
    one layout's steps (its loss, gradients, ledger, bytes held) share one run instead of each stepping
    it again. Each caller gets its own copy of the results. The arguments must say all that the run
    depends on (their repr is the key): no tmp_path, nothing random."""
    key = (world, fn.__module__, fn.__qualname__, repr(args), repr(sorted(kwargs.items())))
    if key not in _recorded:
        _recorded[key] = run_ranks(world, fn, *args, **kwargs)
    return copy.deepcopy(_recorded[key])


def shutdown() -> None:
    """End every pool at the session's end. Killed, not asked to leave: nothing a rank holds needs
    a clean exit any more, and each rank's gloo teardown took seconds (13 s for the pools of 1, 2, 4
    and 8 ranks together on 2 cores, 20 s one pool after another)."""
    for pool in _pools.values():
        pool.close(kill=True)
    _pools.clear()
    _recorded.clear()


def parallel_llama(config, seed: int = 0, tp_group=None, sequence_parallel: bool = False, layer_ids=None,
                   embed: bool = True, head: bool = True, recompute: bool = False, cp_group=None,
                   cp_attention: str = "ring"):
    """The plain Llama(config, seed) through minipar's one seam, `parallelize`: the shorthand the
    tests build their models with. layer_ids, embed, head: this rank's pipeline stages."""
    from minipar.model import Llama
    from minipar.parallelize import parallelize

    stage = None if layer_ids is None and embed and head else (
        list(range(config.n_layers)) if layer_ids is None else list(layer_ids), embed, head)
    return parallelize(Llama(config, seed), tp=tp_group, cp=cp_group, sp=sequence_parallel, stage=stage,
                       recompute=recompute, cp_attention=cp_attention)


def tiers(cases, fast=0, tuple_values=False):
    """A parametrize list whose cases are all marked `integration` (make test-integration) but the
    representative ones `make test` runs: index `fast`, or each index in it. The list itself is left
    as it is, for the ids computed from it and the files that import it.

        @pytest.mark.parametrize("world,layout", tiers(LAYOUTS, fast=3), ids=[...])

    A tuple is one case's values for several argument names, anything else one argument's value;
    tuple_values=True: each tuple is one argument's value."""
    import pytest

    keep = {fast} if isinstance(fast, int) else set(fast)
    assert keep and all(0 <= i < len(cases) for i in keep), (fast, len(cases))
    out = []
    for i, case in enumerate(cases):
        if i in keep:
            out.append(case)
        elif isinstance(case, type(pytest.param())):  # a case with marks of its own keeps them
            out.append(pytest.param(*case.values, marks=[*case.marks, pytest.mark.integration], id=case.id))
        else:
            values = case if isinstance(case, tuple) and not tuple_values else (case,)
            out.append(pytest.param(*values, marks=pytest.mark.integration))
    return out
