"""The checker of the capstone's exercise, 11.1: recompute what is cheap to redo and keep what is not
(docs/11_capstone.md). In one process, in float64, on the small model (4 layers), with the library's
own answer (parallelize.recompute_layers, keep_expensive, _recomputed) switched off while the
student's code runs: its call, and the training steps that run the forwards it installed (a policy
of the library's, handed to torch's checkpoint, is called back from there). It grades the algorithm three ways:

    1. a training step of 2 micro-batches gives the losses and the gradients of the same model
       without recompute (recompute changes when a tensor is made, never its value);
    2. the step runs as many matmuls (aten.mm, counted by a TorchDispatchMode) as without recompute:
       whole-layer and MLP recompute run them again, the expensive part redone;
    3. a layer leaves alive for backward exactly the bytes the estimator gives for
       --recompute-selective (planning/estimate.layer_activation_bytes): measured as the storages
       its forward allocates that are alive when it returns, whoever holds them (autograd, or torch's
       selective-checkpoint cache), plus its input.
"""

from __future__ import annotations

import gc

import torch
from check_common import NotImplementedYet, attempt, load, max_diff, students_code, switched_off
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minipar.model import Llama, get_config
from minipar.planning.estimate import layer_activation_bytes
from minipar.run.config import TrainConfig

RECOMPUTE_OFF = ("minipar.parallelize:recompute_layers", "minipar.parallelize:keep_expensive",
                 "minipar.parallelize:_recomputed", "minipar.parallelize:recompute_mlps")
MICRO, ROWS, SEQ, VOCAB = 2, 4, 32, 250  # 2 micro-batches of 2 sequences of 32 tokens


def _model() -> Llama:
    return Llama(get_config("small", vocab_size=VOCAB), seed=0).double()


def _storages(tree) -> dict:
    return {t.untyped_storage()._cdata: t.untyped_storage() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class _Ops(TorchDispatchMode):
    """Counts each aten op the step runs, and notes each storage an op allocates (not a view's)."""

    def __init__(self):
        super().__init__()
        self.count, self.made = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count[func] = self.count.get(func, 0) + 1
        inputs = _storages((args, kwargs))
        for key, s in _storages(out).items():
            if key not in inputs:
                self.made.setdefault(key, (StorageWeakRef(s), s.nbytes()))
        return out


def _step(model: Llama) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
    """One training step: each micro-batch's forward and backward, the gradients accumulating; the mm count."""
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    losses = []
    with _Ops() as ops:
        for micro in tokens.split(MICRO):
            loss = model(micro[:, :-1], micro[:, 1:]) / (ROWS // MICRO)
            loss.backward()
            losses.append(loss.detach())
    return losses, {n: p.grad for n, p in model.named_parameters()}, ops.count.get(torch.ops.aten.mm.default, 0)


def _layer_keeps(model: Llama) -> int:
    """Bytes one forward of layer 0 leaves alive for backward: what its ops allocated and is still alive
    (its output and the model's own tensors not counted), plus its input."""
    layer = model.layers["0"]
    own = {t.untyped_storage()._cdata for t in [*model.parameters(), layer.attn.rope_freqs]}
    h = torch.randn(MICRO, SEQ, layer.attn_norm.weight.shape[0], dtype=torch.float64, requires_grad=True) * 1.0
    with _Ops() as ops:
        out = layer(h)
    gc.collect()
    gone = own | set(_storages(out))
    return sum(n for key, (ref, n) in ops.made.items() if not ref.expired() and key not in gone) + \
        h.untyped_storage().nbytes()


def check_selective_recompute(path, run_ranks=None) -> list[str]:
    ref_losses, ref_grads, ref_mms = _step(_model())
    model = _model()
    try:
        with switched_off(RECOMPUTE_OFF):
            attempt(load(path).recompute_selectively, model)
            with students_code():  # the layers' forwards are the student's now, and so is what torch calls back
                losses, grads, mms = _step(model)
                kept = _layer_keeps(model)
    except NotImplementedYet as e:
        return [str(e)]
    except Exception as e:  # noqa: BLE001 - the student's error, on one line
        return [f"raised {type(e).__name__}: {e}"]
    problems = [f"micro-batch {i}: the loss differs from the model's without recompute: {max_diff(a, b)}"
                for i, (a, b) in enumerate(zip(losses, ref_losses)) if not torch.allclose(a, b, rtol=1e-12, atol=0)]
    problems += [f"the gradient of {n} differs from the model's without recompute: {max_diff(grads[n], g)}"
                 for n, g in ref_grads.items() if grads.get(n) is None or not torch.allclose(grads[n], g, rtol=1e-10,
                                                                                               atol=1e-12)]
    if problems:
        return problems[:3]
    if mms > ref_mms:
        problems.append(f"the step ran {mms} matmuls (aten.mm), the model without recompute {ref_mms}: "
                        f"{mms - ref_mms} ran again in backward, the most expensive ops redone. Keep every "
                        "matmul's output (CheckpointPolicy.MUST_SAVE) and redo only the cheap ops")
    return problems + _bytes_problems(kept)


def _bytes_problems(kept: int) -> list[str]:
    c, cfg = get_config("small", vocab_size=VOCAB), TrainConfig(model="small", seq_len=SEQ, micro_batch=MICRO,
                                                                  dtype="float64")
    want = layer_activation_bytes(c, TrainConfig(**{**vars(cfg), "recompute_selective": True}))
    plain = layer_activation_bytes(c, cfg)
    say = f"a layer leaves {kept:,} bytes alive for backward ({MICRO} x {SEQ} tokens)"
    if kept == want:
        return []
    if kept > want:
        return [f"{say}, more than the {want:,} of its input, its matmuls' and attention's outputs: the cheap ops' "
                f"outputs are kept too (without recompute a layer keeps {plain:,}). Answer PREFER_RECOMPUTE for "
                "every op but the matmuls and attention"]
    return [f"{say}, less than the {want:,} of its input, its matmuls' and attention's outputs: something "
            "expensive is not kept"]
