"""Pipelines, context and expert parallelism over NCCL, and the estimator's bf16 figures on CUDA.

    pp (1F1B, ZB-V, interleaved), cp (ring attention), ep (experts over all-to-all) and a 3D
    layout, each trained 3 AdamW steps in float64 over NCCL through train.py's own build_model,
    wrap and train_step, equal one GPU: every parameter, gathered whole, to 1e-9
    the estimator under CUDA bf16 autocast: what one layer keeps for backward and what the whole
    forward adds to torch.cuda.memory_allocated, against layer_activation_bytes / activation_bytes
    (on CPU autocast they agree to the byte: tests/test_estimate.py); the ledger of a bf16 step
    over NCCL against bytes_sent, group by group

Each test states the GPUs it needs and skips with the reason when fewer are here (make test-gpu
skips the whole file without CUDA). The rank functions pick their device from the backend (cuda
under NCCL, cpu under gloo), so tests/test_gpu_bodies_on_gloo.py runs their logic on the CPU
before any GPU is lent.
"""

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.run.config import TrainConfig

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
STEPS, ROWS, SEQ, MICRO = 3, 8, 16, 2
OPT = dict(lr=1e-2, weight_decay=0.1, grad_clip=1.0)


def rank_device() -> torch.device:
    """cuda:LOCAL under NCCL (the harness sets the device), the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def batch(step):
    tokens = torch.randint(0, 256, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(2000 + step))
    return tokens[:, :-1], tokens[:, 1:]


def train_config(model: str, **layout) -> TrainConfig:
    return TrainConfig(model=model, seq_len=SEQ, global_batch=ROWS, micro_batch=MICRO, dtype="float64", **OPT,
                       **layout)


def model_config(model: str):
    return get_config(model, n_layers=4)  # ZB-V and interleaved at pp 2 run 4 stages: one layer each


# ----------------------------------------------------------------------------------------------
# Layouts against one GPU, float64
# ----------------------------------------------------------------------------------------------


def one_device(model: str, device) -> dict[str, torch.Tensor]:
    """The plain model trained on the whole global batch, micro-batch by micro-batch as the ranks
    cut it (a mixture of experts' load-balancing loss is per micro-batch: moe.set_aux_scale)."""
    from minipar.data_parallel import param_groups
    from minipar.moe import set_aux_scale
    from minipar.parallelize import adamw

    cfg = train_config(model)
    reference = Llama(model_config(model), seed=cfg.seed).to(device=device, dtype=torch.float64)
    opt = adamw(param_groups(reference, cfg), cfg.lr)
    n = ROWS // MICRO
    for step in range(STEPS):
        set_aux_scale(reference, 1 / n)
        for x, y in zip(*(t.split(MICRO) for t in batch(step))):
            (reference(x.to(device), y.to(device)) / n).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    return {name: p.detach().cpu() for name, p in reference.named_parameters()}


def _layout_equals_one_device(rank, world, model, layout):
    from functools import partial

    from minipar.context_parallel import split_sequence
    from minipar.data_parallel import param_groups
    from minipar.parallelize import adamw, build_grad_sync
    from minipar.run.train import build_model, train_step
    from minipar.tensor_parallel import unshard

    device = rank_device()
    want = one_device(model, device)
    cfg = train_config(model, **layout)
    with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
        if cfg.ep > 1:  # as launch.launch: experts carved out of dp x cp
            mesh.unflatten(("dp", "cp"), edp=cfg.dp * cfg.cp // cfg.ep, ep=cfg.ep)
        net, pipeline = build_model(cfg, mesh, model_config(model), device, torch.float64)
        wrapper = build_grad_sync(net, mesh.groups(), param_groups(net, cfg), partial(adamw, lr=cfg.lr),
                                  zero=cfg.zero, bucket_mb=cfg.bucket_mb, offload=cfg.offload)
        per = ROWS // cfg.dp
        for step in range(STEPS):
            x, y = (t[mesh.coord("dp") * per:(mesh.coord("dp") + 1) * per] for t in batch(step))
            x, y = (split_sequence(t, mesh.groups().cp).to(device) for t in (x, y))
            train_step(wrapper, list(zip(x.split(MICRO), y.split(MICRO))), cfg.grad_clip, pipeline=pipeline)
        with wrapper.gathered():
            got = {n: unshard(p.detach(), p, mesh.groups()).cpu() for n, p in net.named_parameters()}
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], rtol=1e-9, atol=1e-11, msg=name)
    return max((p - want[n]).abs().max().item() for n, p in got.items()), sorted(got)


LAYOUTS = [
    ("tiny", dict(pp=2, schedule="1f1b")),
    ("tiny", dict(pp=2, schedule="zbv")),
    ("tiny", dict(pp=2, schedule="interleaved", virtual_stages=2)),
    ("tiny", dict(cp=2)),
    ("tiny", dict(pp=4, schedule="1f1b")),
    ("tiny", dict(cp=4)),
    ("tiny-moe", dict(dp=2, ep=2)),
    ("tiny-moe", dict(dp=4, ep=4)),
    ("tiny", dict(cp=2, pp=2, schedule="zbv")),
    ("tiny-moe", dict(dp=2, cp=2, pp=2, ep=2)),
]


def world_of(layout: dict) -> int:
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)


@pytest.mark.parametrize("model,layout", LAYOUTS,
                         ids=[m + "-" + "-".join(f"{k}{v}" for k, v in c.items()) for m, c in LAYOUTS])
def test_layout_over_nccl_equals_one_gpu_in_float64(model, layout, report):
    world = world_of(layout)
    if GPUS < world:
        pytest.skip(f"{layout} needs {world} GPUs, {GPUS} here")
    results = run_ranks(world, _layout_equals_one_device, model, layout, backend="nccl", timeout=300)
    held = set().union(*(set(names) for _, names in results))
    assert held == set(one_device(model, torch.device("cpu"))), "some parameter is held by no rank"
    report(f"{model} {layout} over NCCL, float64, {STEPS} AdamW steps: max |param diff| vs one GPU "
           f"{max(w for w, _ in results):.2g}")


# ----------------------------------------------------------------------------------------------
# The estimator's bf16 figures against CUDA autocast
# ----------------------------------------------------------------------------------------------

ACT_SEQ, ACT_MICRO = 256, 2


def _activations_under_autocast(rank, world):
    """(a layer's saved bytes, estimated; the whole forward's memory rise, estimated) on one rank,
    bf16 autocast over fp32 weights as train.precision sets it up. The memory rise is measured
    with torch.cuda.memory_allocated (CUDA) or counted from the saved tensors (CPU)."""
    from test_estimate import kept_for_backward

    from minipar.planning.estimate import activation_bytes, layer_activation_bytes, weight_casts
    from minipar.run.train import precision

    device = rank_device()
    cfg = TrainConfig(model="small", seq_len=ACT_SEQ, micro_batch=ACT_MICRO, dtype="bfloat16")
    c = get_config("small")
    _, param_dtype, autocast = precision(cfg, device)
    model = Llama(c, seed=0).to(device=device, dtype=param_dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, c.vocab_size, (ACT_MICRO, ACT_SEQ + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    with autocast():
        h = torch.randn(ACT_MICRO, ACT_SEQ, c.dim, device=device, requires_grad=True) * 1.0
        layer = kept_for_backward(model.layers["0"], h, skip=params)
    del h
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        with autocast():
            loss = model(x, y)
        whole = torch.cuda.memory_allocated(device) - before - 512  # the loss itself: one 512-byte block
    else:
        with autocast():
            whole = kept_for_backward(model, x, y, skip=params)
        loss = None
    del loss
    return (layer, layer_activation_bytes(c, cfg) + weight_casts(c, cfg)), (whole, activation_bytes(c, cfg))


def test_the_estimators_bf16_activations_match_cuda_autocast(report):
    """On CPU autocast the estimate is exact; CUDA's attention kernels keep their own extras (a
    log-sum-exp padded to their tile, random-number state), so here within 3%, and the report
    gives the bytes for the estimator to be made exact against."""
    (layer, layer_est), (whole, whole_est) = run_ranks(1, _activations_under_autocast, backend="nccl")[0]
    report(f"estimator, bf16 autocast on CUDA, small model, micro-batch {ACT_MICRO} x {ACT_SEQ}: one layer keeps "
           f"{layer:,} B (estimate {layer_est:,}, {layer / layer_est - 1:+.2%}); the forward adds {whole:,} B to "
           f"torch.cuda.memory_allocated (estimate {whole_est:,}, {whole / whole_est - 1:+.2%})")
    assert abs(layer - layer_est) <= 0.03 * layer_est
    assert abs(whole - whole_est) <= 0.03 * whole_est


def _bf16_traffic(rank, world, layout):
    from test_estimate import _dp_traffic  # the CPU test's step and ledger reading, on this rank's GPU

    return _dp_traffic(rank, world, {"dtype": "bfloat16", **layout}, device=rank_device())


TRAFFIC = [dict(tp=2), dict(tp=2, sp=True), dict(cp=2), dict(pp=2), dict(dp=2, zero=1), dict(dp=2, zero=3)]


@pytest.mark.parametrize("layout", TRAFFIC, ids=["-".join(f"{k}{v}" for k, v in c.items()) for c in TRAFFIC])
def test_the_estimators_bf16_traffic_equals_the_ledger_over_nccl(layout, report):
    world = world_of(layout)
    if GPUS < world:
        pytest.skip(f"{layout} needs {world} GPUs, {GPUS} here")
    results = run_ranks(world, _bf16_traffic, layout, backend="nccl", timeout=180)
    for measured, estimated in results:
        assert measured == estimated
    report(f"estimator, bf16 over NCCL, {layout}: bytes sent per step equal the ledger on every rank "
           f"(rank 0: {sum(results[0][0].values()):,} B)")
