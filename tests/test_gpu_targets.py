"""`make test-gpu` and `make bench-gpu` on a machine without CUDA: they say "no GPU" and exit 0."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make test-gpu runs for real")
@pytest.mark.parametrize("target", ["test-gpu", "bench-gpu"])
def test_gpu_targets_say_no_gpu_and_exit_0_without_cuda(target):
    # GPU_PY: the Python running this test (a worktree without .venv would fall back to python3)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_PY=sys.executable, PYTHONPATH=str(ROOT))
    proc = subprocess.run(["make", "-s", target], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU" in proc.stdout
    assert "appended" not in proc.stdout  # nothing was written to docs/benchmarks.md
