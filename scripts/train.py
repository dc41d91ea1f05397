"""Train a Llama-style model with minipar.

    python scripts/train.py                                        # one process, CPU, built-in data
    torchrun --nproc-per-node 2 scripts/train.py --dp 2            # two data-parallel ranks
    python scripts/train.py --help                                 # every flag

The loop itself is minipar/run/train.py; this file only launches it.
"""

import sys

from minipar.run.train import main

if __name__ == "__main__":
    sys.exit(main())
