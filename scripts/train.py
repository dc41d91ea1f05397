"""Train a Llama-style model with minipar.

    python scripts/train.py                                        # one process, CPU, built-in data
    torchrun --nproc-per-node 2 scripts/train.py --dp 2            # two data-parallel ranks
    python scripts/train.py --help                                 # every flag

The command line and its checks are minipar/ops/cli.py, the run's start minipar/run/launch.py and the
loop minipar/run/train.py. This file calls cli.main with the plug-ins from outside the loop: replica
groups on torchft (minipar/extras/replicas.py).
"""

import sys

from minipar.extras import replicas
from minipar.ops.cli import main

if __name__ == "__main__":
    sys.exit(main(extras=[replicas]))
