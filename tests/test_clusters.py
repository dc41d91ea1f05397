"""Several nodes, on one machine: two torchrun "nodes" that meet at a c10d rendezvous train exactly
as one node with the same ranks, and so does scripts/slurm/train.sbatch, run with stand-ins for
srun (which starts the script's torchrun once per node, as Slurm does) and scontrol."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import ROOT, TORCHRUN, common, losses, run

# Several torchrun jobs at once, through train.py: make test-integration.
pytestmark = pytest.mark.integration
TRAIN = str(ROOT / "scripts" / "train.py")
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The reference: dp=2 on one node (torchrun --standalone, 2 workers)."""
    tmp = tmp_path_factory.mktemp("clusters")
    run(common(tmp, dp=2, steps=4, out=tmp / "one", log_json=tmp / "one.jsonl"), nproc=2)
    return tmp


def wait_all(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """(exit code, output) of each process; all are killed if one takes over 300 s."""
    try:
        return [(p.wait(timeout=300), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_two_torchrun_nodes_train_exactly_as_one_node_with_the_same_ranks(one_node):
    tmp = one_node
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    node = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=two-nodes", TRAIN,
            *common(tmp, dp=2, steps=4, out=tmp / "two", log_json=tmp / "two.jsonl")]
    nodes = [subprocess.Popen(node, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    for code, output in wait_all(nodes):
        assert code == 0, output[-3000:]
    assert sorted(losses(tmp / "two.jsonl")) == [1, 2, 3, 4]
    assert losses(tmp / "two.jsonl") == losses(tmp / "one.jsonl")  # bitwise


FAKE_SRUN = """#!/bin/bash
# srun on one machine: the command once per node of the job, all at once; srun's own options skipped.
echo "$@" >> "$SRUN_LOG"
while [[ "$1" == -* ]]; do shift; done
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & done
code=0
for job in $(jobs -p); do wait "$job" || code=$?; done
exit $code
"""
FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST, for the job's list only: this machine, once per node.
[ "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" ] && printf '127.0.0.1\\nlocalhost\\n'
"""


def test_the_slurm_script_starts_one_torchrun_per_node_that_train_as_one_node(one_node):
    tmp = one_node
    bin_ = tmp / "bin"
    bin_.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    port = free_port()
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2",
               SLURM_JOB_ID="4242", SLURM_GPUS_ON_NODE="1", RDZV_PORT=str(port), PYTHON=sys.executable,
               SRUN_LOG=str(tmp / "srun.log"), WANDB_MODE="disabled", SLURM_SUBMIT_DIR=str(ROOT))
    argv = common(tmp, dp=2, steps=4, out=tmp / "slurm", log_json=tmp / "slurm.jsonl")
    job = subprocess.Popen(["bash", str(SBATCH), *argv], cwd=tmp, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    [(code, output)] = wait_all([job])
    assert code == 0, output[-3000:]
    srun = Path(tmp / "srun.log").read_text()
    assert (f"-m torch.distributed.run --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
            f"--rdzv-endpoint=127.0.0.1:{port} --rdzv-id=4242 --max-restarts=0 scripts/train.py") in srun
    assert losses(tmp / "slurm.jsonl") == losses(tmp / "one.jsonl")  # bitwise
