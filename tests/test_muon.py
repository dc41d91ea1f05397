"""Muon (minipar/muon.py) equals torch.optim.Muon with minipar's AdamW on one device, in float64; its
flags are refused where they would change nothing; a run with --optimizer muon learns.

torch.optim.Muon runs Newton-Schulz in bf16 whatever the parameters' dtype, and so does minipar: the
update of a matrix is then a function of the matrix's bf16 values alone, and any layout that
orthogonalises the very same matrix (gathered whole from its shards) gets the very same update. The
float64 comparisons below can therefore ask for 1e-12: only the float64 arithmetic around Newton-Schulz
(gradients summed in another order, clipping) differs, by about 1e-16, which a bf16 rounding of a
momentum element would have to straddle to flip (odds about 1e-16 / 2^-8 per element).
"""

import json

import pytest
import torch
from harness import tiers
from safetensors.torch import load_file
from test_data_parallel import global_batch
from test_train import common, losses, refused, run
from torch import nn

from minipar.data_parallel import param_groups
from minipar.mesh import Groups
from minipar.model import Llama, get_config
from minipar.muon import newton_schulz
from minipar.parallelize import adamw, build_grad_sync, optimizer_of
from minipar.run.config import TrainConfig
from minipar.run.train import train_step
from minipar.zero import kept_whole

# Eight steps' schedule factors: a warm-up then a decay, one factor for both groups' learning rates.
FACTORS = (0.25, 0.5, 0.75, 1.0, 0.9, 0.7, 0.5, 0.3)
CFG = TrainConfig(lr=1e-2, weight_decay=0.1, optimizer="muon", muon_lr=0.02)
VARIANTS = {  # (model, the Muon settings that differ from CFG's)
    "dense": ("tiny", {}),
    "moe-no-nesterov-match-rms": ("tiny-moe", dict(muon_nesterov=False, muon_adjust_lr="match_rms_adamw",
                                                  muon_momentum=0.9, muon_ns_steps=3)),
}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


# The models, by name: a dense one (and 4 layers of it), one with experts, and that one without its
# load-balancing loss (a loss per micro-batch: data parallelism's micro-batches are not one device's).
MODELS = {"tiny": get_config("tiny"), "tiny4": get_config("tiny", n_layers=4), "tiny-moe": get_config("tiny-moe"),
          "tiny-moe-no-aux": get_config("tiny-moe", aux_loss_coef=0.0)}


def new_model(name: str) -> Llama:
    return Llama(MODELS[name], seed=1).double()


def in_muon(name: str, p: torch.Tensor) -> bool:  # the test's own statement of the rule: the blocks' matrices
    return name.startswith("layers.") and p.dim() >= 2


def set_lrs(optimizer, lr: float, muon_lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = muon_lr if g.get("muon") else lr


def minipar_run(model_name: str, cfg: TrainConfig):
    """minipar's one-device step (build_grad_sync on one rank, as the training loop builds it)."""
    model = new_model(model_name)
    wrapper = build_grad_sync(model, Groups(), *optimizer_of(model, cfg, Groups()))
    out = []
    for step, f in enumerate(FACTORS):
        for g in wrapper.optimizer.param_groups:  # as train_loop: lr_at(step) x the group's lr_scale
            g["lr"] = cfg.lr * f * g.get("lr_scale", 1.0)
        out.append(train_step(wrapper, [global_batch(step)], grad_clip=1.0)[0])
    return out, {n: p.detach() for n, p in model.named_parameters()}


def reference_run(model_name: str, cfg: TrainConfig):
    """torch.optim.Muon on the blocks' matrices, each expert's matrix a parameter of its own (copied in and
    out of the model's stacks around each step), and minipar's AdamW on the rest, clipped by torch."""
    model = new_model(model_name)
    params = dict(model.named_parameters())
    matrices = {n: [nn.Parameter(m.clone()) for m in (p.detach() if p.dim() == 3 else [p.detach()])]
                for n, p in params.items() if in_muon(n, p)}
    muon = torch.optim.Muon([m for ms in matrices.values() for m in ms], lr=cfg.muon_lr,
                            weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                            ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr)
    rest = [{**g, "params": [p for p in g["params"] if not any(p is q for q in
                                                                  (params[n] for n in matrices))]}
            for g in param_groups(model, cfg)]
    other = adamw(rest, cfg.lr)
    out = []
    for step, f in enumerate(FACTORS):
        lr = cfg.lr * f
        set_lrs(other, lr, lr)
        set_lrs(muon, lr * (cfg.muon_lr / cfg.lr), 0)
        loss = model(*global_batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for n, ms in matrices.items():
            grads = params[n].grad if params[n].dim() == 3 else [params[n].grad]
            for m, g in zip(ms, grads, strict=True):
                m.grad = g.clone()
        muon.step()
        other.step()
        with torch.no_grad():
            for n, ms in matrices.items():
                params[n].copy_(torch.stack([m.detach() for m in ms]).view_as(params[n]))
        model.zero_grad(set_to_none=True)
        muon.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    return out, {n: p.detach() for n, p in model.named_parameters()}


def test_newton_schulz_equals_torchs_bit_for_bit_on_wide_tall_and_square_matrices():
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(0)
    for shape in [(16, 48), (96, 32), (64, 64)]:
        m = torch.randn(shape, generator=g, dtype=torch.float64)
        ours = newton_schulz(m, 5)
        assert torch.equal(ours, _zeropower_via_newtonschulz(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, EPS))
        # About U V^T: along each of m's singular directions, ours has a singular value near 1 (above a
        # tenth of the largest; five steps cannot raise the tiny ones that far) and none beyond 1.3.
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
        along = torch.diagonal(u.T @ ours.double() @ vh.T)
        assert 0.6 < along[s >= 0.1 * s.max()].min() and torch.linalg.svdvals(ours.double()).max() < 1.3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_device_muon_equals_torch_muon_with_adamw_over_8_steps_in_float64(variant):
    model_name, settings = VARIANTS[variant]
    cfg = TrainConfig(**{**vars(CFG), **settings})
    ours, ours_params = minipar_run(model_name, cfg)
    theirs, their_params = reference_run(model_name, cfg)
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True)) <= 1e-12, (ours, theirs)
    start = new_model(model_name).state_dict()
    for name, p in their_params.items():
        assert relative_error(ours_params[name], p) <= 1e-12, name
        assert not torch.equal(p, start[name])  # every parameter was stepped


LAYER = [1024, 512, 512, 1024, 2048, 2048, 2048]  # tiny's layer: wq, wk, wv, wo, w_gate, w_up, w_down


@pytest.mark.parametrize("sizes,n", [(LAYER, 2), (LAYER, 4), ([7, 1, 1, 1, 9, 3], 3), ([5], 4), ([3, 3], 8)])
def test_kept_whole_ends_every_slice_between_parameters_with_the_least_padding_it_can(sizes, n):
    offsets, padded = kept_whole(sizes, n)
    slice_size = padded // n
    assert padded % n == 0 and offsets == sorted(offsets) and offsets[-1] + sizes[-1] <= padded
    assert all(start // slice_size == (start + size - 1) // slice_size for start, size in zip(offsets, sizes))
    assert all(a + s <= b for a, s, b in zip(offsets, sizes, offsets[1:]))  # in order, never overlapping
    # the largest slice as small as any cut into n runs of consecutive parameters allows (all cuts, tried)
    best = min(max(sum(run) for run in runs) for runs in cuts_into(sizes, n))
    assert slice_size == best


def cuts_into(sizes, n):
    """Every way to cut `sizes` into at most n runs of consecutive items."""
    if n == 1 or len(sizes) <= 1:
        yield [sizes]
        return
    yield [sizes]
    for i in range(1, len(sizes)):
        for rest in cuts_into(sizes[i:], n - 1):
            yield [sizes[:i], *rest]


def test_muon_groups_hold_the_blocks_matrices_and_adamw_the_embedding_head_and_norms():
    model = new_model("tiny-moe")
    groups, _ = optimizer_of(model, CFG, Groups())
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for p in groups[0]["params"])
    assert groups[0]["muon"] and all(not g.get("muon") for g in groups[1:])
    assert "layers.1.moe.experts.w_gate" in muon and "layers.0.attn.wq.weight" in muon
    assert not [n for n in muon if "norm" in n or n.startswith(("tok_emb", "lm_head"))]
    rest = sorted(names[id(p)] for g in groups[1:] for p in g["params"])
    assert sorted(muon + rest) == sorted(names.values())
    assert {"tok_emb.weight", "lm_head.weight", "norm.weight"} <= set(rest)


def test_muon_flags_that_would_change_nothing_or_are_out_of_range_are_refused_in_one_line(tmp_path, monkeypatch,
                                                                                           capsys):
    def line(*extra, **kw):
        return refused(common(tmp_path, **kw) + list(extra), monkeypatch, capsys)

    assert "--muon-lr 0.05 acts only with --optimizer muon, which this run has not" in line(muon_lr=0.05)
    assert "--no-muon-nesterov acts only with --optimizer muon" in line("--no-muon-nesterov")
    assert "--muon-ns-steps 0: give 1 to 99 iterations" in line(optimizer="muon", muon_ns_steps=0)
    assert "--muon-momentum 1.0: give 0 to below 1" in line(optimizer="muon", muon_momentum=1.0)
    assert "--muon-method whole acts only with --optimizer muon with --zero 1 or more" in line(
        optimizer="muon", muon_method="whole")
    assert "invalid choice: 'sgd'" in line(optimizer="sgd")
    assert "invalid choice: 'rms'" in line(optimizer="muon", muon_adjust_lr="rms")


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory):
    """20 steps of scripts/train.py --optimizer muon on one process, saved at steps 10 and 20."""
    tmp = tmp_path_factory.mktemp("muon")
    run(common(tmp, steps=20, save_every=10, optimizer="muon", out=tmp / "m", log_json=tmp / "m.jsonl"))
    return tmp


def test_training_with_optimizer_muon_lowers_the_loss(muon_run):
    loss = losses(muon_run / "m.jsonl")
    assert sorted(loss) == list(range(1, 21))
    first, last = sum(loss[s] for s in range(1, 6)) / 5, sum(loss[s] for s in range(16, 21)) / 5
    assert last < first - 0.5, (first, last)


@pytest.mark.integration
def test_the_readmes_muon_command_trains_on_four_ranks_and_its_loss_falls(tmp_path):
    """`torchrun --nproc-per-node 4 scripts/train.py --dp 2 --tp 2 --optimizer muon` (README), on the tiny model:
    tp gathers each matrix before Newton-Schulz, dp averages the gradients, and the loss falls as on one process."""
    run(common(tmp_path, steps=20, optimizer="muon", dp=2, tp=2, out=tmp_path / "m", log_json=tmp_path / "m.jsonl"),
        nproc=4)
    loss = losses(tmp_path / "m.jsonl")
    first, last = sum(loss[s] for s in range(1, 6)) / 5, sum(loss[s] for s in range(16, 21)) / 5
    assert sorted(loss) == list(range(1, 21)) and last < first - 0.5, (first, last)


def test_the_log_says_muons_learning_rate_beside_adamws(muon_run):
    """Each step's record holds AdamW's lr and Muon's group's: the schedule's one factor times each peak
    (--lr 1e-2, --muon-lr 0.02: twice), and the log line prints both."""
    records = [r for r in map(json.loads, (muon_run / "m.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(records) == 20 and all(r["muon_lr"] == pytest.approx(2 * r["lr"], rel=1e-12) for r in records)
    from minipar.run.run_log import log_line

    line = log_line({**records[0], "sent_by_group": {}, "expert_load": [], "peak_memory": [0],
                     "comm_exposed_s": {}, "bubble": None}, 20)
    assert f"lr {records[0]['lr']:.2e} (muon {records[0]['muon_lr']:.2e}) |" in line


@pytest.mark.parametrize("layout", tiers([{}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 1, "muon_method": "owner"},
                                          {"dp": 2, "zero": 3, "muon_method": "whole"}], fast=0),
                         ids=["same", "dp2-zero1", "dp2-zero1-owner", "dp2-zero3-whole"])
def test_a_muon_run_resumes_its_momentum_and_continues_its_losses(muon_run, layout):
    """The momentum saves by parameter name, as AdamW's moments do, and loads into any layout and method. dp 2
    runs the one process's two micro-batches of 4 rows on its two ranks, and a sum of two gradients is one value
    whichever rank holds which, so the continued losses agree to float64's last bit (1e-15 leaves a mean's
    rounding)."""
    out = muon_run / ("resumed" + "-".join(f"{k}{v}" for k, v in layout.items()))
    run(common(muon_run, steps=20, optimizer="muon", resume=muon_run / "m" / "step_000010", out=out,
               log_json=f"{out}.jsonl", **layout), nproc=layout.get("dp"))
    before, after = losses(muon_run / "m.jsonl"), losses(f"{out}.jsonl")
    assert sorted(after) == list(range(11, 21))
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-15), step
    saved = load_file(muon_run / "m" / "step_000010" / "optimizer.safetensors")
    assert "layers.0.attn.wq.weight/momentum_buffer" in saved and "tok_emb.weight/exp_avg" in saved


def test_a_resume_that_changes_the_optimizer_is_refused_in_one_line(muon_run, monkeypatch, capsys):
    line = refused(common(muon_run, steps=30, resume=muon_run / "m" / "step_000020", out=muon_run / "x")
                   + ["--allow-config-change"], monkeypatch, capsys)
    assert "--optimizer adamw differs from the checkpoint's muon" in line and "pass --optimizer muon" in line
