"""Train a Llama-style model with minipar.

    python scripts/train.py                                        # one process, CPU, built-in data
    torchrun --nproc-per-node 2 scripts/train.py --dp 2            # two data-parallel ranks
    python scripts/train.py --help                                 # every flag

The command line and its checks are minipar/ops/cli.py, the run's start minipar/run/launch.py and the
loop minipar/run/train.py. This file calls cli.main with the plug-ins from outside the loop: replica
groups on torchft (minipar/extras/replicas.py).
"""

import os
import sys

from minipar.extras import replicas
from minipar.ops.cli import main

if __name__ == "__main__":
    code = main(extras=[replicas])
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without tearing down torch's C++ objects at interpreter exit: once in a few hundred runs a
    # process group's thread is destroyed there unjoined ("terminate called without an active
    # exception", SIGABRT), and a finished run, its checkpoint saved and its line said, would exit -6.
    os._exit(code)
