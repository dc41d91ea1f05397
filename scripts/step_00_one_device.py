"""Step 0: one device, and where its memory goes.

    .venv/bin/python scripts/step_00_one_device.py

One training step of the CPU default model (`--model small`) in float32 on one process, with
every byte it holds counted from the tensors themselves: the weights, the gradients, AdamW's two
moments, and the activations autograd keeps for backward (each storage once; the logits among
them). Each figure is printed beside what minipar's estimator (planning/estimate.py) says before
anything runs. The estimator then scales the same arithmetic up to Llama-3.2-1B, 3.1-8B and
3.1-70B in bf16 mixed precision at one 4,096-token sequence, with the days one H100 would take per
billion tokens: where one device stops being enough, in memory and in time.

Chapter: docs/00_one_device.md.
"""

from __future__ import annotations

import torch

from minipar.model import Llama, get_config
from minipar.planning.estimate import activation_bytes, head_activation_bytes, held_bytes
from minipar.run.config import TrainConfig

MiB, GiB = 2**20, 2**30
H100 = 80e9  # bytes of memory on one H100 (80 GB)
H100_FLOPS = 989e12 * 0.4  # its peak dense bf16 FLOP/s (run_log.PEAK_BF16_FLOPS), at a good 40% MFU


def kept_for_backward(step, skip: set[int]) -> int:
    """The bytes of the storages autograd saves while `step` runs (each once; not those in `skip`)."""
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(n for ptr, n in kept.items() if ptr not in skip)


def measure(cfg: TrainConfig) -> dict[str, int]:
    """One step on one process; each kind of bytes, counted from the tensors held."""
    c = get_config(cfg.model)
    model = Llama(c, seed=0)
    shape = (cfg.micro_batch, cfg.seq_len + 1)
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
    cfg = TrainConfig(model="small", seq_len=128, micro_batch=4, global_batch=4, dtype="float32")
    c = get_config(cfg.model)
    psi = sum(p.numel() for p in Llama(c, seed=0).parameters())
    measured = measure(cfg)
    estimate = {**held_bytes(c, cfg), "activations": activation_bytes(c, cfg)}
    print(f"The small model: {c.n_layers} layers, dim {c.dim}, vocabulary {c.vocab_size}: Psi = {psi:,} parameters.")
    print(f"One step in float32 on one process, a micro-batch of {cfg.micro_batch} x {cfg.seq_len} tokens:\n")
    print(f"  {'':32}{'measured':>13}{'estimator':>12}{'per param':>11}")
    rows = [("weights (float32)", "params"), ("gradients (float32)", "grads"),
            ("AdamW momentum and variance", "optimizer"), ("activations kept for backward", "activations")]
    for label, key in rows:
        print(f"  {label:32}{measured[key] / MiB:9.2f} MiB{estimate[key] / MiB:8.2f} MiB{measured[key] / psi:9.1f} B")
    total = sum(measured.values())
    print(f"  {'total':32}{total / MiB:9.2f} MiB")
    gap = measured["activations"] - estimate["activations"]
    ids, scalar = 8 * cfg.micro_batch * (cfg.seq_len + 1), 4  # what the estimator leaves out (said below)
    if gap != ids + scalar:
        raise SystemExit(f"the activations differ from the estimator's by {gap:,} B, not {ids + scalar:,}: look again")
    got, said = measured["activations"], estimate["activations"]
    print(f"\n  activations to the byte: measured {got:,} B, estimator {said:,} B;"
          f"\n  the {gap:,} B between them are the batch's token ids, which the embedding keeps "
          f"({cfg.micro_batch} x {cfg.seq_len + 1} int64,\n  the rows the data loader cut), and one float32 scalar "
          f"of the loss: the estimator counts neither.")
    head = head_activation_bytes(c, cfg)
    states = sum(measured[k] for k in ("params", "grads", "optimizer"))
    print(f"\n  model states: {states / psi:.0f} bytes per parameter. Of the activations, {head / MiB:.2f} MiB "
          f"({head / measured['activations']:.0%}) are\n  the head's: the final norm, the logits "
          f"[{cfg.micro_batch}, {cfg.seq_len}, {c.vocab_size}] and the targets.")


def scaled_up() -> None:
    print("\nThe same arithmetic for real models (the estimator, nothing allocated), bf16 mixed precision:")
    print("bf16 weights and gradients, fp32 master weights, momentum and variance (2 + 2 + 12 = 16 bytes per")
    print("parameter), one sequence of 4,096 tokens:\n")
    print(f"  {'model':8}{'params':>9}" + "".join(f"{h:>12}" for h in ("weights", "grads", "AdamW", "activations"))
          + f"{'total':>11}{'H100s':>7}{'days':>7}")
    for name in ("1b", "8b", "70b"):
        c = get_config(name)
        cfg = TrainConfig(model=name, seq_len=4096, micro_batch=1, global_batch=1, precision="bf16-mixed")
        held = {**held_bytes(c, cfg), "activations": activation_bytes(c, cfg)}
        total = sum(held.values())
        psi = held["grads"] // 2
        print(f"  {name:8}{psi / 1e9:8.2f}B" + "".join(f"{held[k] / GiB:8.1f} GiB" for k in
              ("params", "grads", "optimizer", "activations")) + f"{total / GiB:7.0f} GiB{total / H100:7.1f}"
              + f"{c.flops_per_token(cfg.seq_len) * 1e9 / H100_FLOPS / 86400:7.1f}")
    print("\n  weights: the bf16 copy and the fp32 master, 6 bytes per parameter. H100s: the total over 80 GB.")
    print("  days: to train on one billion tokens on one H100 at 40% of its 989 TFLOP/s (model.flops_per_token).")


if __name__ == "__main__":
    torch.set_num_threads(1)
    small_model()
    scaled_up()
