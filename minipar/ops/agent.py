"""torchrun's elastic agent inside train.py: `python scripts/train.py --nproc-per-node 2 --dp 2`.

train.py takes torchrun's own options (TORCHRUN_OPTIONS), checks the run's command line once
(cli.start_workers), then runs the agent in its own process: it starts the workers (the same
script, with the run's flags), restarts them (--max-restarts) and passes a Ctrl-C on. Run this way,
a bad option is one line, and the agent's own chatter (its OMP banner, a line per worker it signals,
the traceback of a Ctrl-C) stays out of the run's log. Chapter 10 reads it; the course does not.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from minipar.run.config import ConfigError

# torchrun's options that train.py takes itself: `python scripts/train.py --nproc-per-node 2 --dp 2`.
TORCHRUN_OPTIONS = ("--nproc-per-node", "--nnodes", "--node-rank", "--max-restarts", "--master-addr",
                    "--master-port", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--standalone")


def torchrun_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split a command line into torchrun's options (TORCHRUN_OPTIONS, given as `--x y` or `--x=y`;
    returned as `--x=y`) and the run's."""
    agent, run = [], []
    args = iter(argv)
    for a in args:
        name, eq, value = a.partition("=")
        name = name.replace("_", "-")
        if name in TORCHRUN_OPTIONS:
            agent.append(name if name == "--standalone" else f"{name}={value if eq else next(args, '')}")
        else:
            run.append(a)
    return agent, run


def agent_options(agent: list[str]):
    """torchrun's parse of its options, each checked first in one line; restarts need a fresh
    store per attempt (see cli.check_rendezvous), which c10d gives when told, static never."""
    from torch.distributed import run as torchrun
    if "RANK" in os.environ:
        raise ConfigError(f"{agent[0]} is torchrun's option: a worker of torchrun takes only the run's flags")
    for name, _, value in (a.partition("=") for a in agent):
        least = 0 if name in ("--node-rank", "--max-restarts") else 1
        if name in ("--nproc-per-node", "--nnodes", "--node-rank", "--max-restarts", "--master-port") and \
                not (value.isdigit() and int(value) >= least):
            raise ConfigError(f"{name} {value!r}: give a whole number, at least {least} (this launcher takes no "
                              "ranges or 'gpu'; torchrun itself does)")
    if not any(a.startswith("--nproc-per-node=") for a in agent):
        raise ConfigError(f"{agent[0].split('=')[0]} is torchrun's option: give --nproc-per-node N with it")
    opts = torchrun.parse_args([*agent, "train.py"])
    static = opts.rdzv_backend == "static" and not opts.standalone and (
        opts.rdzv_endpoint or opts.master_port is not None or torchrun.parse_min_max_nnodes(opts.nnodes)[1] > 1)
    if opts.max_restarts > 0 and static:
        raise ConfigError(f"--max-restarts {opts.max_restarts} with torchrun's static rendezvous (--master-port): "
                          "drop --master-port and use --standalone, or --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
                          " (a restart could wait on the dead attempt's addresses; see the README)")
    if opts.max_restarts > 0:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # c10d: a fresh store for each attempt
    return opts


def run_agent(agent: list[str], workers_argv: list[str]) -> int:
    """torchrun's agent, in this process, over this script and `workers_argv`. Returns the exit code:
    the first failed worker's, 130 after a Ctrl-C (the workers have said their one line), else 0."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    if "LOGLEVEL" not in os.environ:  # torch's elastic loggers each set their own level (from LOGLEVEL)
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
                logger.setLevel(logging.ERROR)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:  # the agent sets its own handlers of these: put back after
        torchrun.run(torchrun.parse_args([*agent, os.path.abspath(sys.argv[0]), *workers_argv]))
    except ChildFailedError as e:  # each worker has said why in its own line: exit as the first that failed
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 1  # < 0: killed by a signal
    except SignalException as e:  # Ctrl-C: the agent passed it on and waited for the workers' stop (their line)
        return 128 + e.sigval  # 130 for SIGINT, as a shell reports it
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0
