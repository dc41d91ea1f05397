"""The checker of the capstone's exercise, 11.1: recompute each layer's MLP, and only it
(docs/11_capstone.md). In one process, in float64, on the small model (4 layers), with the
library's own answer (parallelize.recompute_mlps, and `_recomputed`, which it wraps each block in)
switched off while the student's code runs. It grades the algorithm three ways:

    1. a training step of 2 micro-batches gives the losses and the gradients of the same model
       without recompute (recompute changes when a tensor is made, never its value);
    2. the MLP's forward runs twice per layer and micro-batch (in forward, and again in backward)
       and attention's once: forward pre-hooks on each layer's w_gate and wq count their calls;
    3. a layer keeps for backward exactly the bytes the estimator gives for --recompute-mlp
       (planning/estimate.layer_activation_bytes), counted by saved_tensors_hooks as chapter 0
       counts them: full-layer recompute keeps less (its input alone), no recompute more.
"""

from __future__ import annotations

import torch
from check_common import NotImplementedYet, attempt, load, max_diff, switched_off

from minipar.model import Llama, get_config
from minipar.planning.estimate import layer_activation_bytes
from minipar.run.config import TrainConfig

RECOMPUTE_OFF = ("minipar.parallelize:recompute_mlps", "minipar.parallelize:_recomputed")
MICRO, ROWS, SEQ, VOCAB = 2, 4, 32, 250  # 2 micro-batches of 2 sequences of 32 tokens


def _model() -> Llama:
    return Llama(get_config("small", vocab_size=VOCAB), seed=0).double()


def _step(model: Llama) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One training step: each micro-batch's forward and backward, the gradients accumulating."""
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    losses = []
    for micro in tokens.split(MICRO):
        loss = model(micro[:, :-1], micro[:, 1:]) / (ROWS // MICRO)
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad for n, p in model.named_parameters()}


def _layer_keeps(layer: torch.nn.Module, params: set) -> int:
    """Bytes of the distinct storages autograd saves in one forward of `layer` (its weights not counted)."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    h = torch.randn(MICRO, SEQ, layer.attn_norm.weight.shape[0], dtype=torch.float64, requires_grad=True) * 1.0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(h)
    return sum(n for ptr, n in kept.items() if ptr not in params)


def check_selective_recompute(path, run_ranks=None) -> list[str]:
    ref_losses, ref_grads = _step(_model())
    model = _model()
    calls = {"mlp": 0, "attention": 0}
    for layer in model.layers.values():  # on their first linears, so that a wrapper is counted too, and a
        # replay too, which stops once it has rebuilt what backward needs (before w_down returns)
        layer.mlp.w_gate.register_forward_pre_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
        layer.attn.wq.register_forward_pre_hook(lambda *_: calls.__setitem__("attention", calls["attention"] + 1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    try:
        with switched_off(RECOMPUTE_OFF):
            attempt(load(path).recompute_mlps, model)
            losses, grads = _step(model)
            stepped = dict(calls)  # the step's; the count of bytes below runs a forward more
            kept = _layer_keeps(model.layers["0"], params)
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
    runs = ROWS // MICRO * len(model.layers)  # layers x micro-batches in the step
    if stepped["mlp"] != 2 * runs:
        problems.append(f"the MLPs' forward ran {stepped['mlp']} times in a step of {ROWS // MICRO} micro-batches "
                        f"through {len(model.layers)} layers, expected {2 * runs}: once in forward and once "
                        "more in backward, per layer and micro-batch")
    if stepped["attention"] != runs:
        problems.append(f"attention's forward ran {stepped['attention']} times, expected {runs}: attention keeps its "
                        "activations and is not recomputed")
    return problems + _bytes_problems(kept, stepped["mlp"] == 2 * runs)


def _bytes_problems(kept: int, ran_twice: bool) -> list[str]:
    c, cfg = get_config("small", vocab_size=VOCAB), TrainConfig(model="small", seq_len=SEQ, micro_batch=MICRO,
                                                                  dtype="float64")
    want = layer_activation_bytes(c, TrainConfig(**{**vars(cfg), "recompute_mlp": True}))
    plain, full = layer_activation_bytes(c, cfg), layer_activation_bytes(c, TrainConfig(**{**vars(cfg),
                                                                                           "recompute": True}))
    say = f"a layer keeps {kept:,} bytes for backward ({MICRO} x {SEQ} tokens)"
    if kept == want:
        return []
    if kept == full:
        return [f"{say}, its input alone: that is full-layer recompute, which redoes attention too. Keep "
                f"attention's activations and recompute only the MLP: {want:,} bytes"]
    if kept >= plain:
        how = ("the MLP ran again in backward, but its first forward kept all it saves, so nothing was saved"
               if ran_twice else "the MLP still saves gate, silu(gate), up and their product (4 x ffn numbers a "
               "token)")
        return [f"{say}, all it keeps without recompute ({plain:,}): {how}. Run the MLP under "
                f"torch.utils.checkpoint, which keeps only its input: {want:,} bytes"]
    return [f"{say}; recomputing the MLP alone keeps {want:,} (the estimator's layer_activation_bytes with "
            f"recompute_mlp; without recompute {plain:,}, recomputing the whole layer {full:,})"]
