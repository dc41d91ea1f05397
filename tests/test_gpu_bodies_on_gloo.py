"""The GPU suite's rank functions, run on gloo: their logic is proven before a GPU is lent.

tests/gpu runs only where CUDA is (make test-gpu), and a GPU is lent rarely; a test body broken by
a refactor would be found only then. Its rank functions take their device from the backend (cuda
under NCCL, the CPU under gloo), so here a few of them run on 2 CPU ranks, unchanged: DP, ZeRO-3
and TP against one device, the collectives and their ledger, the pipeline (ZB-V), cp and ep
layouts against one device in float64, and the estimator's bf16 traffic and activations under
CPU autocast (where the activation estimate is exact to the byte).
"""

import sys
from pathlib import Path

import pytest
from harness import run_ranks, tiers

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def _on_gloo(rank, world, module, name, *args):
    if str(GPU_TESTS) not in sys.path:
        sys.path.insert(0, str(GPU_TESTS))
    return getattr(__import__(module), name)(rank, world, *args)


@pytest.mark.parametrize("kind", tiers(["zero3", "tp"], fast=0))
def test_the_gpu_suites_wrapper_check_passes_on_gloo(kind):
    worst = run_ranks(2, _on_gloo, "test_gpu", "_wrapper_equals_one_device", kind, timeout=300)
    assert max(worst) < 1e-9


def test_the_gpu_suites_collectives_check_passes_on_gloo():
    ledgers = run_ranks(2, _on_gloo, "test_gpu", "_collectives")
    assert ledgers[0]["dp/all_reduce"]["sent"] > 0


@pytest.mark.parametrize("model,layout", tiers([("tiny", dict(pp=2, schedule="zbv")), ("tiny", dict(cp=2)),
                                                ("tiny-moe", dict(dp=2, ep=2))], fast=0),
                         ids=["pp2-zbv", "cp2", "moe-dp2-ep2"])
def test_the_gpu_suites_layout_check_passes_on_gloo(model, layout):
    results = run_ranks(2, _on_gloo, "test_gpu_layouts", "_layout_equals_one_device", model, layout, timeout=300)
    assert max(w for w, _ in results) < 1e-9


def test_the_gpu_suites_bf16_traffic_check_passes_on_gloo():
    for measured, estimated in run_ranks(2, _on_gloo, "test_gpu_layouts", "_bf16_traffic", dict(tp=2, sp=True)):
        assert measured == estimated and measured


def test_the_gpu_suites_bf16_activation_check_is_exact_on_cpu_autocast():
    (layer, layer_est), (whole, whole_est) = run_ranks(1, _on_gloo, "test_gpu_layouts",
                                                       "_activations_under_autocast")[0]
    assert layer == layer_est
    assert abs(whole - whole_est) <= 0.01 * whole_est
