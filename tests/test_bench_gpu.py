"""bench_gpu.py's two sides of every strategy do the same work, proven on the CPU before any GPU.

A GPU benchmark whose sides computed different things would compare different work. Its hidden
`--device cpu` mode runs the very code the GPU runs (the same builders, batches and loss
reduction) on gloo in float32, without autocast; here, on 2 ranks and the tiny model:

    every strategy, minipar and PyTorch's peer, two steps each: the first step's loss equals the
    one-device loss of that step's global batch (same weights, same tokens), and the two sides'
    second-step losses agree (the same update was applied)

torch's context_parallel has no CPU kernels, so cp's torch side is checked to say so; its real
run waits for a GPU (make bench-gpu). The slow test runs the orchestrator itself, every side in
fresh torchrun processes, as `make bench-gpu` does.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ["dp", "zero1", "zero2", "zero3", "tp", "pp", "cp"]
FLAGS = ["--device", "cpu", "--ranks", "2", "--models", "tiny", "--steps", "1", "--warmup", "1", "--seq-len", "16",
         "--accum", "2", "--micro-batch", "2"]


def bench_gpu():
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gpu as module

    return module


def _both_sides(rank, world, strategy):
    from minipar.mesh import Mesh

    b = bench_gpu()
    args = b.parse_args(FLAGS)
    out = {}
    for side in ("minipar", "torch"):
        with Mesh.build(**{b.DIMENSION.get(strategy, "dp"): world}) as mesh:
            try:
                out[side] = b.measure(strategy, side, "tiny", args, mesh, torch.device("cpu"), 2)
            except NotImplementedError as e:
                out[side] = {"error": str(e)}
    return out


def one_device_first_loss(strategy: str) -> float:
    """The plain model's mean loss over the whole global batch of step 0, as bench_gpu draws it."""
    from minipar.model import Llama, get_config

    b = bench_gpu()
    args = b.parse_args(FLAGS)
    rows = b.rows_per_step(strategy, args, 2, 2)
    tokens = torch.randint(0, 256, (rows, 17), generator=torch.Generator().manual_seed(1_000_003))
    return Llama(get_config("tiny"), seed=0)(tokens[:, :-1], tokens[:, 1:]).item()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_both_sides_of_each_bench_gpu_strategy_compute_the_one_device_loss(strategy):
    results = run_ranks(2, _both_sides, strategy, timeout=300)
    assert results[0]["minipar"]["losses"] == results[1]["minipar"]["losses"]  # reduced over the ranks
    ours, theirs = results[0]["minipar"], results[0]["torch"]
    want = one_device_first_loss(strategy)
    assert ours["losses"][0] == pytest.approx(want, rel=1e-6)
    if strategy == "cp":  # no torch peer on CPU: it says so
        assert "no CPU peer" in theirs["error"]
        return
    assert theirs["losses"][0] == pytest.approx(want, rel=1e-6)
    assert theirs["losses"][1] == pytest.approx(ours["losses"][1], rel=1e-5)
    assert ours["losses"][1] != ours["losses"][0]  # the first step changed the weights
    assert ours["tokens_per_s"] > 0 and theirs["tokens_per_s"] > 0


@pytest.mark.slow
def test_the_bench_gpu_orchestrator_runs_each_side_in_fresh_processes_on_cpu(tmp_path):
    rows_file = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu.py"), *FLAGS, "--strategies", "tp", "pp", "cp",
           "--rows", str(rows_file)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["strategy"]: r for r in json.loads(rows_file.read_text())}
    for strategy in ("tp", "pp"):
        a, b = rows[strategy]["minipar"], rows[strategy]["torch"]
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5), strategy
    assert "no CPU peer" in rows["cp"]["torch"]["error"]
    assert "| tiny | tp | DTensor TP |" in proc.stdout
