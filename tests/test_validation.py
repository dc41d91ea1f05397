"""Validation: the held-out loss is the one-device loss of the held-out windows under every layout,
and measuring it changes nothing: no weight, no gradient, no optimizer state.

The held-out windows come from a real token file (batches.py holds out whole documents); the
reference runs the plain model over the same windows, on one device, in float64."""

import json
import sysconfig
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from harness import run_ranks, tiers

from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.run.batches import TokenData
from minipar.run.config import TrainConfig
from minipar.run.data import prepare

SEQ, ROWS, SEED, FRACTION = 16, 8, 5, 0.4
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validation")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "colorsys.py"):
        (corpus / name).write_text((STDLIB / name).read_text())
    return prepare(str(corpus), vocab_size=300, cache_dir=tmp / "cache")


def model_config(model: str, vocab: int):
    return get_config(model, vocab_size=vocab, n_layers=4)  # 4 layers: 2 stages per rank at pp 2


def one_device(folder, model: str, batches: int) -> float:
    """The mean token loss of the held-out batches, by the plain model on one device."""
    data = TokenData(folder, SEQ, SEED, FRACTION)
    llama = Llama(model_config(model, data.vocab_size), seed=SEED).double()
    with torch.no_grad():
        losses = [llama(*data.fetch(data.val_order[k * ROWS:(k + 1) * ROWS], data.val_windows)).item()
                  for k in range(batches)]
    return sum(losses) / batches


def _validate(rank, world, folder, model, layout, micro):
    from functools import partial

    import minipar.run.train as train
    from minipar.data_parallel import param_groups
    from minipar.parallelize import adamw, build_grad_sync
    from minipar.run.run_log import RunLog
    from minipar.run.validation import validate
    from minipar.tensor_parallel import unshard

    cfg = TrainConfig(model=model, seq_len=SEQ, global_batch=ROWS, micro_batch=micro, dtype="float64", seed=SEED,
                      val_fraction=FRACTION, eval_batches=2, wandb=False, **layout)
    data = TokenData(folder, SEQ, SEED, FRACTION)
    with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
        if cfg.ep > 1:
            mesh.unflatten(("dp", "cp"), edp=cfg.dp * cfg.cp // cfg.ep, ep=cfg.ep)
        torch.manual_seed(cfg.seed)
        model, pipeline = train.build_model(cfg, mesh, model_config(model, data.vocab_size), torch.device("cpu"),
                                            torch.float64)
        wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr),
                                  zero=cfg.zero, bucket_mb=cfg.bucket_mb, offload=cfg.offload)

        def weights():
            with wrapper.gathered():
                return {n: unshard(p.detach(), p, mesh.groups()).clone() for n, p in model.named_parameters()}
        before = weights()
        share = validate(cfg, data, mesh, wrapper, pipeline, nullcontext, torch.device("cpu"))
        val = RunLog(cfg, mesh, torch.device("cpu")).validation(0, share, pipeline, 2 * ROWS)
        after = weights()
        untouched = all(torch.equal(before[n], after[n]) for n in before)
        no_grads = all(p.grad is None for p in model.parameters()) and not wrapper.optimizer.state
        return val, untouched, no_grads


LAYOUTS = [  # (world, model, layout, micro-batch)
    (1, "tiny", dict(), 2),
    (2, "tiny", dict(dp=2), 2),
    (2, "tiny", dict(tp=2), 4),
    (2, "tiny", dict(pp=2), 2),
    (2, "tiny", dict(cp=2), 4),
    (2, "tiny", dict(pp=2, schedule="interleaved", virtual_stages=2), 1),
    (2, "tiny", dict(pp=2, schedule="zbv"), 2),
    (4, "tiny", dict(dp=2, tp=2, sp=True), 2),
    (4, "tiny", dict(dp=2, cp=2, zero=3), 2),
    (4, "tiny", dict(dp=2, pp=2, zero=1), 2),
    (2, "tiny-moe", dict(dp=2, ep=2), 2),
]


@pytest.mark.parametrize("world,model,layout,micro", tiers(LAYOUTS, fast=9),  # make test: dp2 x pp2, ZeRO-1
                         ids=[f"{c[1]}-" + ("-".join(f"{k}{v}" for k, v in c[2].items()) or "one") for c in LAYOUTS])
def test_the_validation_loss_is_the_one_device_loss_and_leaves_the_model_untouched(folder, world, model, layout,
                                                                                    micro):
    reference = one_device(folder, model, batches=2)
    for val, untouched, no_grads in run_ranks(world, _validate, folder, model, layout, micro, timeout=300):
        assert val == pytest.approx(reference, rel=1e-12)  # every rank gets the gathered value
        assert untouched and no_grads


class FakeWandb:
    def __init__(self):
        self.logged = []

    def log(self, values, step):
        self.logged.append((values, step))


def _log_validation(rank, world, path):
    from minipar.run.run_log import RunLog

    cfg = TrainConfig(model="tiny", steps=20, wandb=False, log_json=str(path))
    with Mesh.build() as mesh:
        log = RunLog(cfg, mesh, torch.device("cpu"))
        log.wandb, log.run_id = FakeWandb(), "run0"  # as start() sets them; the file is made with its first record
        val = log.validation(9, 2.5, None, 16)
        log.file.close()
        return val, log.wandb.logged


def test_the_validation_loss_goes_to_the_json_log_and_wandb_at_its_step(tmp_path):
    val, logged = run_ranks(1, _log_validation, tmp_path / "log.jsonl")[0]
    assert val == 2.5 and logged == [({"step": 10, "val_loss": 2.5}, 10)]
    assert json.loads((tmp_path / "log.jsonl").read_text()) == {"run_id": "run0", "step": 10, "val_loss": 2.5}
