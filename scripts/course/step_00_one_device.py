"""Step 0: one device, and where its memory goes.

    .venv/bin/python scripts/course/step_00_one_device.py

One training step of the CPU default model (`--model small`) in float32 on one process, with
every byte it holds counted from the tensors themselves: the weights, the gradients, AdamW's two
moments, and the activations autograd keeps for backward (each storage once; the logits among
them), a layer's share read off a model with two layers fewer. Then the model states of
Llama-3.2-1B, 3.1-8B and 3.1-70B in bf16 mixed precision, from their parameter counts alone, with
the days one H100 would take per billion tokens: where one device stops being enough, in memory and
in time. Only chapter 0's code: the model (minipar/model.py).

Chapter: docs/00_one_device.md.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minipar.model import Llama, ModelConfig, get_config

MiB, GiB = 2**20, 2**30
H100 = 80e9  # bytes of memory on one H100 (80 GB)
H100_FLOPS = 989e12 * 0.4  # its peak dense bf16 FLOP/s (run_log.PEAK_BF16_FLOPS), at a good 40% MFU
MICRO_BATCH, SEQ_LEN = 4, 128


def kept_for_backward(step, skip: set[int]) -> int:
    """The bytes of the storages autograd saves while `step` runs (each once; not those in `skip`)."""
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(n for ptr, n in kept.items() if ptr not in skip)


def measure(c: ModelConfig) -> dict[str, int]:
    """One step on one process; each kind of bytes, counted from the tensors held."""
    model = Llama(c, seed=0)
    shape = (MICRO_BATCH, SEQ_LEN + 1)
    tokens = torch.randint(0, c.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    losses = []
    activations = kept_for_backward(lambda: losses.append(model(tokens[:, :-1], tokens[:, 1:])), weights)
    losses[0].backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    params = list(model.parameters())
    return {"params": sum(p.nbytes for p in params), "grads": sum(p.grad.nbytes for p in params),
            "optimizer": sum(t.nbytes for t in moments), "activations": activations}


def small_model() -> None:
    c = get_config("small")
    psi = c.num_params()
    measured = measure(c)
    shallower = measure(replace(c, n_layers=c.n_layers - 2))["activations"]
    layer = (measured["activations"] - shallower) // 2  # what one transformer layer keeps
    print(f"The small model: {c.n_layers} layers, dim {c.dim}, vocabulary {c.vocab_size}: Psi = {psi:,} parameters.")
    print(f"One step in float32 on one process, a micro-batch of {MICRO_BATCH} x {SEQ_LEN} tokens, every byte "
          f"counted\nfrom the tensors held:\n")
    print(f"  {'':32}{'measured':>13}{'per param':>11}")
    rows = [("weights (float32)", "params"), ("gradients (float32)", "grads"),
            ("AdamW momentum and variance", "optimizer"), ("activations kept for backward", "activations")]
    for label, key in rows:
        print(f"  {label:32}{measured[key] / MiB:9.2f} MiB{measured[key] / psi:9.1f} B")
    print(f"  {'total':32}{sum(measured.values()) / MiB:9.2f} MiB")
    states = sum(measured[k] for k in ("params", "grads", "optimizer"))
    rest = measured["activations"] - c.n_layers * layer
    print(f"\n  model states: {states / psi:.0f} bytes per parameter. Of the activations, each of the {c.n_layers} "
          f"layers keeps\n  {layer / MiB:.2f} MiB ({layer / (MICRO_BATCH * SEQ_LEN * c.dim * 4):.0f} float32 numbers "
          f"per token per unit of the width {c.dim}; measured against a model\n  of {c.n_layers - 2} layers), and "
          f"the rest, {rest / MiB:.2f} MiB ({rest / measured['activations']:.0%}), is the head's: the final norm, "
          f"the\n  logits [{MICRO_BATCH}, {SEQ_LEN}, {c.vocab_size}], the targets and the batch's token ids.")


def scaled_up() -> None:
    print("\nThe model states of real models, from their parameter counts alone, in bf16 mixed precision:")
    print("bf16 weights and gradients, fp32 master weights, momentum and variance (2 + 2 + 12 = 16 bytes per")
    print("parameter); the activations come on top:\n")
    print(f"  {'model':8}{'params':>9}" + "".join(f"{h:>12}" for h in ("weights", "grads", "AdamW"))
          + f"{'total':>11}{'H100s':>7}{'days':>7}")
    for name in ("1b", "8b", "70b"):
        c = get_config(name)
        psi = c.num_params()
        held = {"params": 6 * psi, "grads": 2 * psi, "optimizer": 8 * psi}
        total = sum(held.values())
        print(f"  {name:8}{psi / 1e9:8.2f}B" + "".join(f"{held[k] / GiB:8.1f} GiB" for k in
              ("params", "grads", "optimizer")) + f"{total / GiB:7.0f} GiB{total / H100:7.1f}"
              + f"{c.flops_per_token(4096) * 1e9 / H100_FLOPS / 86400:7.1f}")
    print("\n  weights: the bf16 copy and the fp32 master, 6 bytes per parameter. H100s: the total over 80 GB.")
    print("  days: to train on one billion tokens of 4,096-token sequences on one H100 at 40% of its 989 TFLOP/s")
    print("  (model.flops_per_token).")


if __name__ == "__main__":
    torch.set_num_threads(1)
    small_model()
    scaled_up()
