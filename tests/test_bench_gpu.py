"""bench_gpu.py's two sides of every strategy do the same work, proven on the CPU before any GPU.

A GPU benchmark whose sides computed different things would compare different work. Its hidden
`--device cpu` mode runs the very code the GPU runs (the same builders, batches and loss
reduction) on gloo in float32, without autocast; here, on 2 ranks and the tiny model:

    every strategy, minipar and PyTorch's peer, two steps each: both steps' losses equal those of
    the plain model on one device trained the same way (the same weights and tokens, then the
    same AdamW update of the whole global batch's gradient)

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
from harness import run_ranks, tiers

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ["dp", "zero1", "zero2", "zero3", "tp", "tp_overlap", "pp", "cp"]
FLAGS = ["--device", "cpu", "--ranks", "2", "--models", "tiny", "--steps", "1", "--warmup", "1", "--seq-len", "16",
         "--accum", "2", "--micro-batch", "2"]


def bench_gpu():
    if str(ROOT / "scripts" / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts" / "bench"))
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


def one_device_losses(strategy: str) -> list[float]:
    """The plain model on one device, trained as bench_gpu's sides train (the same AdamW, clipping
    at 1.0): its loss on the whole global batch of step 0, one step, then its loss on step 1's."""
    from minipar.data_parallel import param_groups
    from minipar.model import Llama, get_config
    from minipar.parallelize import adamw
    from minipar.run.config import TrainConfig

    b = bench_gpu()
    args = b.parse_args(FLAGS)
    rows = b.rows_per_step(strategy, args, 2, 2)
    model = Llama(get_config("tiny"), seed=0)
    opt = adamw(param_groups(model, TrainConfig(model="tiny", lr=args.lr)), args.lr)
    losses = []
    for step in range(2):
        tokens = torch.randint(0, 256, (rows, 17), generator=torch.Generator().manual_seed(1_000_003 + step))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses


# float32, each side summing in its own order (dp shares, tp-split logits, ZeRO's flat buffers, pp's
# stages): a loss over 64-128 tokens' 256-way softmax, its logits ~600 roundings of eps 1.2e-7 deep, errs by
# ~eps x sqrt(900) = 4e-6 of itself (seen: 1.3e-7); the first AdamW step moves a weight by lr whatever its
# gradient's rounding. Relative 1e-5; absolute 0, the losses being ~5.5.
LOSS_TOL = dict(rel=1e-5, abs=0)


@pytest.mark.float32
@pytest.mark.parametrize("strategy", tiers(STRATEGIES, fast=3))  # make test: zero3 (FSDP2)
def test_both_sides_of_each_bench_gpu_strategy_train_as_one_device(strategy):
    results = run_ranks(2, _both_sides, strategy, timeout=300)
    assert results[0]["minipar"]["losses"] == results[1]["minipar"]["losses"]  # reduced over the ranks
    ours, theirs = results[0]["minipar"], results[0]["torch"]
    want = one_device_losses(strategy)
    assert want[1] != want[0]  # the first step changed the weights
    assert ours["losses"] == pytest.approx(want, **LOSS_TOL)
    assert ours["tokens_per_s"] > 0
    if strategy == "cp":  # no torch peer on CPU: it says so
        assert "no CPU peer" in theirs["error"]
        return
    assert theirs["losses"] == pytest.approx(want, **LOSS_TOL)
    assert theirs["tokens_per_s"] > 0


def _fsdp_reduce_scatters(rank, world, strategy):
    """How many reduce-scatters bench_gpu's FSDP2 side posts in its warm-up and timed steps."""
    import torch.distributed as dist

    from minipar.mesh import Mesh

    b, calls = bench_gpu(), []
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(dist, name, counted)
    try:
        with Mesh.build(dp=world) as mesh:
            b.measure(strategy, "torch", "tiny", b.parse_args(FLAGS), mesh, torch.device("cpu"), 2)
    finally:
        setattr(dist, name, original)
    return len(calls)


@pytest.mark.parametrize("strategy", tiers(["zero2", "zero3"], fast=0))
def test_the_fsdp2_peer_reduce_scatters_every_micro_batch_as_zero_does(strategy):
    """ZeRO-2 and -3 hold a shard of the gradient between micro-batches, so they reduce-scatter after
    each; a peer that synchronised only the last (set_requires_gradient_sync(False) before) would send
    a quarter of the messages at --accum 4 and hold the whole gradient: other work. FSDP2 posts one
    reduce-scatter a module (each layer and the root) a micro-batch."""
    from minipar.model import get_config

    args = bench_gpu().parse_args(FLAGS)
    per_micro_batch = get_config("tiny").n_layers + 1
    steps = args.warmup + args.steps
    assert run_ranks(2, _fsdp_reduce_scatters, strategy, timeout=300) == [
        steps * args.accum * per_micro_batch] * 2


@pytest.mark.slow
@pytest.mark.float32
def test_the_bench_gpu_orchestrator_runs_each_side_in_fresh_processes_on_cpu(tmp_path):
    rows_file = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench" / "bench_gpu.py"), *FLAGS, "--strategies", "tp", "pp", "cp",
           "--rows", str(rows_file)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["strategy"]: r for r in json.loads(rows_file.read_text())}
    for strategy in ("tp", "pp"):
        a, b = rows[strategy]["minipar"], rows[strategy]["torch"]
        assert a["losses"] == pytest.approx(b["losses"], **LOSS_TOL), strategy
    assert "no CPU peer" in rows["cp"]["torch"]["error"]
    assert "| tiny | tp | DTensor TP |" in proc.stdout
