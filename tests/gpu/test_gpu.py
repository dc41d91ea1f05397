"""minipar on CUDA with NCCL: the same proofs as on CPU, on the GPUs present (make test-gpu).

    the model on CUDA equals the model on CPU (float64 tight, float32 to rounding)
    every collective over NCCL gives the local result and the ledger's bytes (1 GPU: a world of 1)
    the clock of exposed communication reads the stream's wait from CUDA events, not the host's
    DP and ZeRO 1/2/3 (and TP on 2+ GPUs) over NCCL equal one CUDA device in float64
    several processes on one GPU: tried, and the report says whether NCCL allows it
    train.py in bfloat16 autocast follows the float32 losses over 50 steps
    the largest layout the GPUs allow (dp2 x tp2 x pp2 on 8) equals one GPU in float32
    (pipelines, cp, ep and the estimator's bf16 figures: test_gpu_layouts.py)

Skipped as a whole without CUDA (conftest.py); never part of `make test`. The rank functions run
on gloo too: tests/test_gpu_bodies_on_gloo.py proves their logic on the CPU.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import parallel_llama, run_ranks
from test_gpu_layouts import rank_device

from minipar import collectives as C
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
OPT = TrainConfig(lr=1e-2, weight_decay=0.1)
STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16


def batch(step, device):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)
    return x.to(device), torch.roll(x, -1, dims=1).to(device)


# ----------------------------------------------------------------------------------------------
# One device: CUDA against CPU
# ----------------------------------------------------------------------------------------------


# float32: CUDA and the CPU sum in other orders; the small model's longest sums (4096-way softmax, 384-wide
# MLP, 128-wide projections) round within eps 1.2e-7 a term: up to ~5e-4 of a value, ~1e-5 typically (the
# square root of the length), so 2e-4 relative and absolute. Seen on an H100: 3.4e-8 at worst.
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
def test_model_on_cuda_equals_the_model_on_cpu(dtype, tol, report):
    out = {}
    for device in ("cpu", "cuda"):
        model = Llama(get_config("small"), seed=0).to(device=device, dtype=dtype)
        x, y = batch(0, device)
        loss = model(x, y)
        loss.backward()
        out[device] = (loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["cuda"][0], out["cpu"][0], rtol=tol, atol=tol)
    worst = max((out["cuda"][1][n] - g).abs().max().item() for n, g in out["cpu"][1].items())
    for n, g in out["cpu"][1].items():
        torch.testing.assert_close(out["cuda"][1][n], g, rtol=tol, atol=tol, msg=n)
    report(f"model cuda vs cpu, {dtype}: loss {out['cuda'][0].item():.6f}, max |grad diff| {worst:.2g}")


# ----------------------------------------------------------------------------------------------
# NCCL: collectives, and the parallel wrappers against one device
# ----------------------------------------------------------------------------------------------


def _collectives(rank, world):
    device = rank_device()  # cuda under NCCL; the CPU under gloo (tests/test_gpu_bodies_on_gloo.py)
    with Mesh.build(dp=world) as mesh:
        group = mesh.groups().dp
        inputs = [torch.arange(24, dtype=torch.float64, device=device).view(4, 6) * (r + 1) for r in range(world)]
        x, n, nbytes = inputs[rank], world, inputs[rank].numel() * 8
        t = x.clone()
        C.all_reduce(t, group)
        torch.testing.assert_close(t, sum(inputs))
        torch.testing.assert_close(C.all_gather(x, group, dim=1), torch.cat(inputs, dim=1))
        big = x.repeat(world, 1)
        torch.testing.assert_close(C.reduce_scatter(big, group), sum(i.repeat(world, 1) for i in inputs).chunk(n)[rank])
        t = x.clone()
        C.broadcast(t, group, src=world - 1)
        torch.testing.assert_close(t, inputs[-1])
        t = x.clone()
        C.ring_all_reduce(t, group)
        torch.testing.assert_close(t, sum(inputs))
        got = mesh.ledger.snapshot()
        assert got["dp/all_reduce"]["sent"] == 2 * (n - 1) * nbytes // n
        assert got["dp/all_gather"]["sent"] == (n - 1) * nbytes
        return got


@pytest.mark.parametrize("world", sorted({1, GPUS}) if GPUS else [1])
def test_collectives_over_nccl(world, report):
    ledgers = run_ranks(world, _collectives, backend="nccl", timeout=120)
    report(f"NCCL collectives on {world} GPU(s): equal to the local computation; rank 0 sent "
           f"{sum(e['sent'] for e in ledgers[0].values())} bytes as the ledger counts")


def test_the_wait_clock_reads_the_streams_wait_and_the_host_waits_for_nothing(report):
    """comm_clock on CUDA: a call that only queues GPU work (as NCCL's do) returns at once, and its
    span is the time the stream spent in it, read from events after a synchronize."""
    from minipar.comm_clock import WaitClock

    clock, began = WaitClock(cuda=True), time.perf_counter()
    clock.run("tp", torch.cuda._sleep, 100_000_000)  # queued: about 0.05 s of the GPU's cycles
    host = time.perf_counter() - began
    torch.cuda.synchronize()  # what the training log's step() already does before it reads the clock
    stream = clock.seconds()["tp"]
    assert stream > 0.005 and stream > 5 * host, (stream, host)
    report(f"wait clock on CUDA: a queued 1e8-cycle sleep timed at {stream * 1e3:.1f} ms on the stream, "
           f"{host * 1e6:.0f} µs on the host")


def test_several_processes_on_one_gpu(report):
    """Two ranks on one GPU: NCCL refuses this in most versions; the report says which it was."""
    world = 2 * GPUS
    try:
        run_ranks(world, _collectives, backend="nccl", timeout=60)
    except (RuntimeError, TimeoutError) as e:
        reason = next((line for line in str(e).splitlines() if "Duplicate GPU" in line or "NCCL" in line),
                      str(e).splitlines()[-1])
        report(f"{world} processes on {GPUS} GPU(s) with NCCL: refused ({reason.strip()[:160]})")
        pytest.skip(f"NCCL does not run two ranks on one GPU here: {reason.strip()[:160]}")
    report(f"{world} processes on {GPUS} GPU(s) with NCCL: collectives correct")


def _wrapper_equals_one_device(rank, world, kind):
    from minipar.data_parallel import param_groups
    from minipar.parallelize import adamw, build_grad_sync
    from minipar.run.train import train_step

    device = rank_device()  # cuda under NCCL; the CPU under gloo (tests/test_gpu_bodies_on_gloo.py)
    cfg = get_config("tiny")
    reference = Llama(cfg, seed=1).to(device=device, dtype=torch.float64)
    ref_opt = adamw(param_groups(reference, OPT), OPT.lr)
    tp = world if kind == "tp" else 1
    with Mesh.build(dp=world // tp, tp=tp) as mesh:
        model = parallel_llama(cfg, seed=1, tp_group=mesh.groups().tp).to(device=device, dtype=torch.float64)
        stage = {"dp": 0, "tp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[kind]
        wrapped = build_grad_sync(model, mesh.groups(), param_groups(model, OPT), lambda pgs: adamw(pgs, OPT.lr),
                                  zero=stage, bucket_mb=0.02)
        per = GLOBAL_BATCH // mesh.layout.dp
        for step in range(STEPS):
            x, y = batch(step, device)
            reference(x, y).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            rows = slice(mesh.coord("dp") * per, (mesh.coord("dp") + 1) * per)
            micro = list(zip(x[rows].chunk(2), y[rows].chunk(2)))
            train_step(wrapped, micro, 1.0)
        ctx = wrapped.gathered() if kind == "zero3" else __import__("contextlib").nullcontext()
        with ctx, torch.no_grad():
            worst = 0.0
            full = dict(reference.named_parameters())
            for name, p in model.named_parameters():
                want = full[name]
                if tuple(p.shape) != tuple(want.shape):  # a tp shard: this rank's slice of the full tensor
                    dim = next(d for d in range(p.dim()) if p.shape[d] != want.shape[d])
                    want = want.narrow(dim, mesh.coord("tp") * p.shape[dim], p.shape[dim])
                torch.testing.assert_close(p, want, rtol=1e-9, atol=1e-11, msg=name)
                worst = max(worst, (p - want).abs().max().item())
        return worst


@pytest.mark.parametrize("kind", ["dp", "zero1", "zero2", "zero3", "tp"])
def test_parallel_wrappers_over_nccl_equal_one_gpu_in_float64(kind, report):
    world = GPUS
    if kind == "tp" and world < 2:
        pytest.skip("tensor parallelism needs 2 GPUs or more")
    worst = max(run_ranks(world, _wrapper_equals_one_device, kind, backend="nccl", timeout=180))
    report(f"{kind} over NCCL on {world} GPU(s), float64, {STEPS} AdamW steps: max |param diff| vs one GPU {worst:.2g}")


# ----------------------------------------------------------------------------------------------
# train.py on the GPUs: bfloat16 against float32, and the largest layout against one GPU
# ----------------------------------------------------------------------------------------------


def train(tmp: Path, name: str, nproc: int, *extra: str) -> dict[int, float]:
    log = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "scripts" / "train.py"), "--model=small", "--no-wandb", f"--out={tmp / name}",
           f"--log-json={log}", "--log-every=10", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, WANDB_MODE="disabled"))
    if proc.returncode:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}


def layout(gpus: int) -> dict[str, int]:
    """The README's headline on 8 GPUs, else the largest that fits."""
    return {8: dict(dp=2, tp=2, pp=2), 4: dict(dp=1, tp=2, pp=2), 2: dict(dp=1, tp=2, pp=1)}.get(
        gpus, dict(dp=gpus, tp=1, pp=1))


def flags(lay: dict[str, int]) -> list[str]:
    return [f"--{k}={v}" for k, v in lay.items()]


def test_bfloat16_autocast_follows_float32_over_50_steps(tmp_path, report):
    """Tolerance: bf16 rounds each matmul's inputs to 8 bits of mantissa, so the curves part a
    little; over 50 steps of the small model the mean gap must stay under 0.05 nats and every
    step's under 0.15, while both fall by more than 1.5 nats."""
    lay = layout(GPUS)
    common = [*flags(lay), "--steps=50", "--warmup=10", "--lr=1e-3", "--micro-batch=2"]
    f32 = train(tmp_path, "f32", GPUS, *common, "--dtype=float32")
    bf16 = train(tmp_path, "bf16", GPUS, *common, "--dtype=bfloat16")
    gaps = [abs(bf16[s] - f32[s]) for s in f32]
    worst = max(f32, key=lambda s: abs(bf16[s] - f32[s]))
    report(f"train.py {lay} bf16 vs fp32, 50 steps: loss {f32[1]:.3f} -> {f32[50]:.3f} (fp32), "
           f"{bf16[50]:.3f} (bf16); mean |gap| {sum(gaps) / len(gaps):.4f}, max {max(gaps):.4f} at step {worst}")
    report("  fp32 every 5th step: " + " ".join(f"{f32[s]:.3f}" for s in range(1, 51, 5)))
    report("  bf16 every 5th step: " + " ".join(f"{bf16[s]:.3f}" for s in range(1, 51, 5)))
    assert f32[1] - f32[50] > 1.5 and bf16[1] - bf16[50] > 1.5
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 0.15
    assert max(gaps) > 0, "the bf16 run gave the float32 losses exactly: autocast did not run"


def test_largest_layout_equals_one_gpu_in_float32(tmp_path, report):
    lay = layout(GPUS)
    if GPUS < 2:
        pytest.skip("one GPU: the layout is a single rank (run by the bf16 test)")
    common = ["--steps=10", "--dtype=float32", "--micro-batch=2"]
    one = train(tmp_path, "one", 1, *common)
    many = train(tmp_path, "many", GPUS, *flags(lay), *common)
    worst = max(abs(many[s] - one[s]) / one[s] for s in one)
    report(f"train.py {lay} on {GPUS} GPUs vs one GPU, float32, 10 steps: max relative loss gap {worst:.2g}")
    # float32 rounding (~1e-6 of the loss a step, other summation orders across the ranks), carried
    # through 10 AdamW steps: 1e-4 relative leaves a hundredfold; a wrong layout moves the loss by 1e-2.
    assert worst < 1e-4
