"""Exercise 11.1 (the capstone, docs/11_capstone.md), implement: recompute what is cheap to redo, keep what is not.

Korthikanti et al. (2022, section 5) and torchtitan's selective activation checkpointing share one
principle: an op whose output is large to keep and cheap to compute again (a norm, RoPE, SiLU, an
element-wise product) is redone in backward; an op that is expensive to redo (a matmul, attention)
keeps its output. Whole-layer recompute (`--recompute`) redoes every matmul, a third more compute;
recomputing the MLP (`--recompute-mlp`) redoes its three matmuls, the most expensive part of a layer.

Write `recompute_selectively(model)`: change, in place, each transformer layer (`model.layers[name]`)
so that in a training step

  - the losses and the gradients are those of the model without recompute (float64, to rounding);
  - no matmul runs again: the step runs as many `aten.mm` as without recompute;
  - a layer leaves alive for backward exactly what `planning/estimate.layer_activation_bytes` gives
    with `recompute_selective=True`: its input, each projection's output (q, k, v, wo, w_gate, w_up,
    w_down) and attention's output and log-sum-exp; nothing the norms, RoPE, SiLU or the products make.

Use torch's own selective checkpointing: `torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False,
context_fn=...)` with `create_selective_checkpoint_contexts(policy)`, a policy(ctx, op, *args, **kwargs)
answering `CheckpointPolicy.MUST_SAVE` or `PREFER_RECOMPUTE` for each aten op. On the CPU, a linear is
`torch.ops.aten.mm.default` and attention `torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default`.
The checker counts the step's ops with a TorchDispatchMode and the bytes by the storages forward
allocates that are still alive when it returns. The library's own answer (`minipar.parallelize`'s
`recompute_layers`, `keep_expensive`, `_recomputed`) is switched off while your code runs.

Check: make exercise N=11.1 (one process, a few seconds)
"""

from minipar.model import Llama


def recompute_selectively(model: Llama) -> None:
    """Each layer keeps its input and its matmuls' and attention's outputs; the cheap ops run again in backward."""
    raise NotImplementedError("hint: a policy that keeps aten.mm's and attention's outputs, handed to "
                              "create_selective_checkpoint_contexts in a context_fn; set each layer.forward to a "
                              "function that runs the layer's own forward under torch.utils.checkpoint.checkpoint")
