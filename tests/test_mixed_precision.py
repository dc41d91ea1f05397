"""bf16-mixed (precision.py): the ZeRO paper's (2 + 2 + 12) Psi held byte for byte under ZeRO 0-3,
the estimator equal to it, a loss curve within bf16's reach of fp32's, and every layout equal to
one process to the tolerance bf16 sums allow."""

import pytest
import torch
from harness import run_ranks, tiers

from minipar.mesh import Mesh
from minipar.model import get_config
from minipar.run.config import TrainConfig

pytestmark = pytest.mark.float32  # bf16 results within derived tolerances: run again under other CPU kernels

MIXED = dict(precision="bf16-mixed", dtype=None)


def _train_objects(cfg: TrainConfig, mesh, model_cfg, optimizer=None):
    """The model and wrapper train.py builds for cfg (model in fp32, the wrapper makes it bf16)."""
    from functools import partial

    from minipar.data_parallel import param_groups
    from minipar.parallelize import adamw, build_grad_sync
    from minipar.precision import of_config
    from minipar.run.train import build_model

    torch.set_num_threads(1)
    model, pipeline = build_model(cfg, mesh, model_cfg, torch.device("cpu"), of_config(cfg).built)
    wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), optimizer or partial(adamw, lr=cfg.lr),
                              zero=cfg.zero, bucket_mb=cfg.bucket_mb, precision=of_config(cfg))
    return model, pipeline, wrapper


# ----------------------------------------------------------------------------------------------
# Memory: every storage the wrapper holds, walked and sorted by what it is
# ----------------------------------------------------------------------------------------------

BUCKET_ROLE = {"full": "weights", "shard": "weights", "master": "master", "grad_slice": "grads", "buffer": "buffers"}


def storages_by_kind(wrapper) -> dict[str, int]:
    """{"kind dtype": bytes} over every storage reachable from the wrapper (each counted once): the
    model's weights and gradients, the optimizer's parameters (masters), their gradients and state,
    and every tensor a bucket holds (flat weights, shards, gradient slices, all-reduce buffers)."""
    seen: dict[int, tuple[str, int]] = {}

    def add(kind, t):
        if t is not None and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in seen:
            seen[t.untyped_storage().data_ptr()] = (f"{kind} {str(t.dtype).removeprefix('torch.')}",
                                                    t.untyped_storage().nbytes())
    for p in wrapper.module.parameters():
        add("weights", p)
        add("grads", p.grad)
    for group in wrapper.optimizer.param_groups:
        for m in group["params"]:
            add("master", m)
            add("grads", m.grad)
    for state in wrapper.optimizer.state.values():
        for v in state.values():
            add("moments", v if torch.is_tensor(v) and v.dim() else None)
    for b in wrapper.buckets:
        for name, v in vars(b).items():
            add(BUCKET_ROLE.get(name, name), v if torch.is_tensor(v) else None)
    out: dict[str, int] = {}
    for kind, nbytes in seen.values():
        out[kind] = out.get(kind, 0) + nbytes
    return out


def _held(rank, world, zero):
    from minipar.planning.estimate import held_bytes
    from minipar.run.train import train_step

    cfg = TrainConfig(model="tiny", seq_len=16, global_batch=4, micro_batch=2, dp=world, zero=zero,
                      bucket_mb=0.01, **MIXED)
    model_cfg = get_config("tiny", vocab_size=256)
    with Mesh.build(dp=world) as mesh:
        model, _, wrapper = _train_objects(cfg, mesh, model_cfg)
        x = torch.randint(0, 256, (4 // world, 16), generator=torch.Generator().manual_seed(rank))
        micro = list(zip(x.split(2), x.split(2)))
        train_step(wrapper, micro, 1.0)  # AdamW's moments exist from the first step on
        wrapper(*micro[0], 1.0).backward()  # the step's last backward: gradients at their fullest
        at_backward = storages_by_kind(wrapper)
        wrapper.finish_grad_sync()
        return dict(at_backward=at_backward, synced=storages_by_kind(wrapper), measured=wrapper.held_bytes(),
                    estimated=held_bytes(model_cfg, cfg), psi=sum(p.numel() for p in model.parameters()),
                    padded=sum(b.padded for b in getattr(wrapper, "buckets", [])) if zero else 0)


HELD = [(1, 0), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1), (4, 2), (4, 3)]


@pytest.mark.parametrize("world,zero", tiers(HELD, fast=[2, 3, 4, 5]), ids=[f"dp{w}-zero{z}" for w, z in HELD])
def test_bf16_mixed_holds_2_2_12_psi_split_as_each_zero_stage_splits_it(world, zero):
    for r in run_ranks(world, _held, zero):
        psi, n = r["psi"], world
        shard = r["padded"] // n  # ZeRO's slices: each bucket padded to a multiple of N, then cut in N
        # The paper's table at the end of backward: bf16 weights and gradients, fp32 master, m and v.
        expected = {"weights bfloat16": 2 * (shard if zero == 3 else psi),
                    "grads bfloat16": 2 * (shard if zero >= 2 else psi),
                    "master float32": 4 * (shard if zero else psi), "moments float32": 8 * (shard if zero else psi)}
        if zero == 0 and n > 1:  # DataParallel's flat all-reduce buffers, bf16 on the wire
            expected["buffers bfloat16"] = 2 * psi
        assert r["at_backward"] == expected
        assert sum(expected.values()) - expected.get("buffers bfloat16", 0) == (
            16 * psi if zero == 0 else 16 * shard if zero == 3 else 4 * psi + 12 * shard if zero == 1 else
            2 * psi + 14 * shard)
        # Once synced, ZeRO-1 has traded its full gradients for their slices: the estimator's moment.
        synced = r["synced"]
        assert synced["grads bfloat16"] == 2 * (shard if zero else psi)
        assert r["measured"] == {"params": synced["weights bfloat16"] + synced["master float32"],
                                 "grads": synced["grads bfloat16"] + synced.get("buffers bfloat16", 0),
                                 "optimizer": synced["moments float32"]}
        assert r["estimated"] == r["measured"]


# ----------------------------------------------------------------------------------------------
# fp32 against bf16-mixed over 100 steps
# ----------------------------------------------------------------------------------------------


def _curve(rank, world, precision, steps):
    from minipar.run.train import train_step

    cfg = TrainConfig(model="tiny", seq_len=32, global_batch=4, micro_batch=4, lr=3e-3, precision=precision)
    with Mesh.build() as mesh:
        _, _, wrapper = _train_objects(cfg, mesh, get_config("tiny", vocab_size=64))
        g = torch.Generator().manual_seed(0)
        motifs = torch.randint(0, 64, (8, 8), generator=g)  # sequences of repeated 8-token motifs: learnable
        losses = []
        for _ in range(steps):
            rows = motifs[torch.randint(0, 8, (4,), generator=g)].repeat(1, 5)[:, :33]
            losses.append(train_step(wrapper, [(rows[:, :-1], rows[:, 1:])], 1.0)[0])
        return losses


def test_bf16_mixed_follows_the_fp32_loss_curve_over_100_steps():
    fp32, mixed = (run_ranks(1, _curve, p, 100)[0] for p in ("fp32", "bf16-mixed"))
    # Tolerance. bf16 keeps 8 significant bits: each weight, activation and gradient is rounded by up to
    # a relative 2^-8, so one forward of this 2-layer model moves the loss by a few 2^-8 relative (about
    # 0.04 at a loss of 4). The fp32 masters take every update whole, so the runs do not drift apart by
    # rounding the updates away; what accumulates is the difference of 100 gradients each a few 2^-8
    # off, which Adam turns into updates of the same relative size. A relative 2^-4 (6%) of the loss
    # covers that with room; a broken master (updates lost to bf16 rounding, lr 3e-3 on weights of
    # 0.02: a 2^-3 relative step, half of it rounded away) or a wrong gradient scale lands far outside.
    assert fp32[-1] < 0.6 * fp32[0]  # the runs learn something, so the comparison means something
    print(f"fp32 vs bf16-mixed: worst relative loss difference {max(abs(a - b) / a for a, b in zip(fp32, mixed)):.2e}"
          f" over {len(fp32)} steps, tolerance {2**-4:.2e}")
    for step, (a, b) in enumerate(zip(fp32, mixed)):
        assert abs(a - b) <= 2**-4 * a, f"step {step}: fp32 {a:.4f}, bf16-mixed {b:.4f}"


# ----------------------------------------------------------------------------------------------
# Checkpoints hold the fp32 masters: a resumed run continues bit for bit, and fp32 runs load them
# ----------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_bf16_mixed_zero2_checkpoint_resumes_bit_for_bit_and_loads_into_an_fp32_run(tmp_path):
    from safetensors.torch import load_file
    from test_train import common, losses, run

    def argv(name, **over):  # scripts/train.py's flags: bf16-mixed instead of the float64 of test_train
        return [a for a in common(tmp_path, steps=6, save_every=3, out=tmp_path / name,
                                  log_json=tmp_path / f"{name}.jsonl", **over) if not a.startswith("--dtype")]

    run(argv("whole", dp=2, zero=2, precision="bf16-mixed"), nproc=2)
    saved = tmp_path / "whole" / "step_000003"
    assert {t.dtype for t in load_file(saved / "model.safetensors").values()} == {torch.float32}  # the masters
    run(argv("resumed", dp=2, zero=2, precision="bf16-mixed", resume=saved), nproc=2)
    whole, resumed = losses(tmp_path / "whole.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == whole[s] for s in resumed), (whole, resumed)
    # The same checkpoint in an fp32 run on one process: it loads (the layout may change on resume, the
    # precision when asked, and the run says so), and continues within bf16's reach of the bf16-mixed
    # run (the curve test's 2^-4).
    changed = run(argv("fp32", precision="fp32", resume=saved) + ["--allow-config-change"])
    assert "precision changes from the checkpoint's bf16-mixed to fp32 (--allow-config-change)" in changed.stdout
    fp32 = losses(tmp_path / "fp32.jsonl")
    assert sorted(fp32) == [4, 5, 6] and all(abs(fp32[s] - whole[s]) <= 2**-4 * whole[s] for s in fp32), (whole, fp32)
    assert fp32 != resumed  # it did run in fp32: bf16's roundings are gone


# ----------------------------------------------------------------------------------------------
# Layouts: one SGD step at lr 1 in bf16-mixed, so each fp32 master moves by its averaged gradient
# ----------------------------------------------------------------------------------------------

ROWS, SEQ = 8, 16


def _moved(rank, world, layout):
    from minipar.context_parallel import split_sequence
    from minipar.run.train import train_step
    from minipar.tensor_parallel import unshard

    cfg = TrainConfig(model=layout.pop("model", "tiny"), seq_len=SEQ, global_batch=ROWS, micro_batch=2,
                      weight_decay=0.0, grad_clip=0.0, bucket_mb=0.01, **MIXED, **layout)
    with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
        if cfg.ep > 1:
            mesh.unflatten(("dp", "cp"), edp=cfg.dp * cfg.cp // cfg.ep, ep=cfg.ep)
        model, pipeline, wrapper = _train_objects(cfg, mesh, get_config(cfg.model, vocab_size=256),
                                                  lambda groups: torch.optim.SGD(groups, lr=1.0))
        with wrapper.gathered():  # the fp32 masters
            before = {n: unshard(p.detach(), p, mesh.groups()).clone() for n, p in model.named_parameters()}
        x = torch.randint(0, 256, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
        per = ROWS // cfg.dp
        x = x[mesh.coord("dp") * per:(mesh.coord("dp") + 1) * per]
        x, y = (split_sequence(t, mesh.groups().cp) for t in (x[:, :-1], x[:, 1:]))
        train_step(wrapper, list(zip(x.split(2), y.split(2))), 0.0, pipeline=pipeline)
        with wrapper.gathered():
            return {n: before[n] - unshard(p.detach(), p, mesh.groups()) for n, p in model.named_parameters()}


def gradients(world, layout) -> dict[str, torch.Tensor]:
    out = {}
    for moved in run_ranks(world, _moved, dict(layout), timeout=300):
        out.update(moved)
    return out


def worst_relative_error(got: dict, want: dict) -> float:
    """max over tensors of |got - want| / |want| (Frobenius norms)."""
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want)


# What reorders the sums: one process adds the whole batch's contributions inside each matmul (an fp32
# accumulator, rounded once to bf16). A layout adds them in pieces, each rounded to bf16 before the
# next sum: dp rounds each rank's gradient, then sums them in bf16 across ranks; tp rounds each rank's
# partial products before their all-reduce; pp and cp hand bf16 activations between ranks computed in
# another order; ep adds the experts' tokens in another order. Each rounding moves a value by up to
# u = 2^-8 of it; through forward and backward of two layers a gradient gathers a few tens of them,
# partly cancelling: 16 u = 2^-4 of its norm bounds that, yet a gradient averaged with a wrong scale
# (a factor 2: error 1) or missing a rank's half of the batch (about 1/2) lands far outside it.
# Measured (tiny, CPU, printed with -s): dp and ZeRO 1-3 1.1-1.4 u, ep 1.3 u, tp 2.5-3.2 u, cp 3.7 u,
# pp 0 (each stage runs one process's very sums): the tolerance is 4x the worst, not loose by 10x.
LAYOUT_TOLERANCE = 2**-4
PARITY = [(2, dict(dp=2)), (2, dict(dp=2, zero=1)), (2, dict(dp=2, zero=2)), (2, dict(dp=2, zero=3)),
          (2, dict(tp=2, sp=True)), (2, dict(pp=2)), (2, dict(cp=2)), (2, dict(tp=2, recompute=True)),
          (2, dict(model="tiny-moe", dp=2, ep=2))]


ONE_PROCESS: dict[str, dict] = {}  # the reference of each model, computed once per session


@pytest.mark.parametrize("world,layout", tiers(PARITY, fast=4),
                         ids=["-".join(f"{k}{v}" for k, v in c[1].items()) for c in PARITY])
def test_bf16_mixed_gradients_equal_one_process_under_every_layout(world, layout):
    model = layout.get("model", "tiny")
    if model not in ONE_PROCESS:
        ONE_PROCESS[model] = gradients(1, dict(model=model))
    error = worst_relative_error(gradients(world, layout), ONE_PROCESS[model])
    margin = f"{LAYOUT_TOLERANCE / error:.0f}x below it" if error else "bit-identical"
    print(f"{layout}: worst relative error {error:.2e}, tolerance {LAYOUT_TOLERANCE:.2e} ({margin})")
    assert error < LAYOUT_TOLERANCE


# ----------------------------------------------------------------------------------------------
# --grad-reduce: what fp32 on the wire buys over bf16, measured against the exact mean
# ----------------------------------------------------------------------------------------------
# Each rank's gradient is bf16 (8 significant bits: a rounding moves a value by at most u = 2^-8 of
# it, half an ulp). The wrappers divide it by N (exact: N = 4) and sum over the ranks.
#   fp32: the sum of four bf16 values in fp32 is exact up to fp32's own roundings (3 of 2^-24 each),
#         then rounded once to bf16: within half a bf16 ulp of the exact mean (plus those 2^-24s).
#   bf16: gloo adds the ranks' values pairwise in bf16, rounding each of the N - 1 partial sums; by
#         the textbook bound for any order of summation the error is at most gamma_{N-1} * sum |g_i| / N,
#         gamma_k = k u / (1 - k u): three roundings, and of partial sums that can exceed the mean.
# At dp 2 the two settings agree bit for bit: a bf16 add of two bf16 values is their exact sum
# rounded once, which is what fp32 gives too. Hence dp 4 here.

REDUCE_N, REDUCE_NUMEL = 4, 4096


class _Weighted(torch.nn.Module):
    """sum(w * x): the gradient of w is x, the rank's own bf16 values, exactly."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(REDUCE_NUMEL))

    def forward(self, x):
        return (self.w * x).sum()


def _reduced(rank, world, grad_reduce, zero):
    from minipar.collectives import all_gather
    from minipar.parallelize import build_grad_sync
    from minipar.precision import resolve

    g = torch.Generator().manual_seed(rank)  # magnitudes over 2^-6 .. 2^6 and both signs: sums that cancel
    x = (torch.randn(REDUCE_NUMEL, generator=g) * 2.0 ** torch.randint(-6, 7, (REDUCE_NUMEL,), generator=g))
    x = x.to(torch.bfloat16)
    with Mesh.build(dp=world) as mesh:
        model = _Weighted()
        wrapper = build_grad_sync(model, mesh.groups(), [{"params": list(model.parameters())}],
                                  lambda groups: torch.optim.SGD(groups, lr=1.0), zero=zero, bucket_mb=1.0,
                                  precision=resolve("bf16-mixed", grad_reduce=grad_reduce))
        mesh.ledger.reset()
        wrapper(x).backward()
        wrapper.finish_grad_sync()
        sent = mesh.ledger.total_sent()
        got = model.w.grad if zero == 0 else wrapper.buckets[0].grad_slice
        mine = slice(None) if zero == 0 else wrapper.buckets[0].slice
        every = all_gather(x.double()[None], mesh.groups().dp)  # [N, numel]: every rank's gradient
        return dict(got=got.double(), mean=every.mean(0)[mine], abs_mean=every.abs().mean(0)[mine],
                    dtype=got.dtype, sent=sent)


def half_ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Half the spacing of bf16 numbers at x: 2^(e - 8) for |x| in [2^(e-1), 2^e)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 9)


@pytest.mark.parametrize("zero", tiers([0, 2], fast=1), ids=["all-reduce", "reduce-scatter"])
def test_grad_reduce_fp32_rounds_the_mean_once_and_bf16_within_its_three_roundings_dp4(zero):
    u = 2.0**-8
    results = {how: run_ranks(REDUCE_N, _reduced, how, zero) for how in ("fp32", "bf16")}
    for fp32, bf16 in zip(results["fp32"], results["bf16"]):
        assert fp32["dtype"] == bf16["dtype"] == torch.bfloat16  # held in bf16 either way
        mean, spread = fp32["mean"], fp32["abs_mean"]  # the exact mean (float64), and sum |g_i| / N
        fp32_error, bf16_error = (fp32["got"] - mean).abs(), (bf16["got"] - mean).abs()
        fp32_bound = half_ulp_bf16(mean) + 3 * 2.0**-24 * spread
        gamma = 3 * u / (1 - 3 * u)
        assert (fp32_error <= fp32_bound).all(), f"fp32 off by {float((fp32_error / fp32_bound).max()):.3f} bounds"
        assert (bf16_error <= gamma * spread).all(), f"bf16 off by {float((bf16_error / (gamma * spread)).max()):.3f}"
        # What fp32 buys is real: bf16's extra roundings leave some means further than half an ulp.
        beyond = (bf16_error > half_ulp_bf16(mean) + 3 * 2.0**-24 * spread).float().mean()
        print(f"zero {zero}: bf16 beyond half an ulp on {float(beyond):.1%} of elements; "
              f"worst bf16 error {float((bf16_error / (gamma * spread)).max()):.2f} of its bound")
        assert beyond > 0.01
        assert fp32["sent"] == 2 * bf16["sent"]  # and what it costs: twice the bytes


# ----------------------------------------------------------------------------------------------
# Offload: ZeRO's fp32 slices (masters, Adam's moments) and the update on the host
# ----------------------------------------------------------------------------------------------


def _two_steps(rank, world, offload):
    from functools import partial

    from minipar.data_parallel import param_groups
    from minipar.parallelize import adamw, build_grad_sync
    from minipar.precision import of_config
    from minipar.run.train import build_model, train_step

    torch.set_num_threads(1)
    cfg = TrainConfig(model="tiny", seq_len=16, global_batch=8, micro_batch=2, dp=2, zero=2, lr=1e-2, **MIXED)
    with Mesh.build(dp=2) as mesh:
        model, _ = build_model(cfg, mesh, get_config("tiny"), torch.device("cpu"), of_config(cfg).built)
        wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr), zero=2,
                                  offload=offload, precision=of_config(cfg))
        x = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))[rank * 4:(rank + 1) * 4]
        losses = [train_step(wrapper, list(zip(x[:, :-1].split(2), x[:, 1:].split(2))), 1.0)[0] for _ in range(2)]
        state = [t for s in wrapper.optimizer.state.values() for t in s.values() if t.dim() > 0]
        with wrapper.gathered():  # the fp32 masters, whole
            masters = {n: p.detach().clone() for n, p in model.named_parameters()}
        working = {p.dtype for p in model.parameters()}
        return losses, masters, working, {(t.device.type, t.dtype) for t in state}


def test_bf16_mixed_with_offload_steps_exactly_as_without():
    """--offload moves ZeRO 1-2's fp32 slices and their update to the CPU. Here the device is the CPU
    already, so the two runs must agree bit for bit: what this proves is that the offload path keeps
    bf16-mixed's fp32 masters and moments (and rounds into bf16 working weights) as the plain one does.
    The copies between a GPU and the host are not tested: no test here or in tests/gpu runs offload
    on a GPU."""
    plain, offloaded = (run_ranks(2, _two_steps, offload) for offload in (False, True))
    for (losses, masters, working, state), (losses_o, masters_o, working_o, state_o) in zip(plain, offloaded):
        assert losses == losses_o and losses[1] < losses[0]
        assert all(torch.equal(masters[n], masters_o[n]) for n in masters)
        assert {m.dtype for m in masters_o.values()} == {torch.float32} and working_o == working == {torch.bfloat16}
        assert state_o == state == {("cpu", torch.float32)}
