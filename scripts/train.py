"""Train a Llama-style model with minipar.

    python scripts/train.py                                        # one process, CPU, built-in data
    torchrun --nproc-per-node 2 scripts/train.py --dp 2            # two data-parallel ranks
    python scripts/train.py --help                                 # every flag

The start-up is minipar/run/launch.py and the loop minipar/run/train.py; this file only calls launch.main.
"""

import sys

from minipar.run.launch import main

if __name__ == "__main__":
    sys.exit(main())
