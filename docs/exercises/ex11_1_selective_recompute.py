"""Exercise 11.1 (the capstone, docs/11_capstone.md), implement: recompute each layer's MLP, and only it.

Whole-layer recompute (`--recompute`) keeps each layer's input and runs the whole layer again in
backward: a third more compute. Most of what a Llama layer keeps is its MLP's: gate, silu(gate),
up and their product, 4 x ffn numbers a token, against some 10 x d for everything else. Keep
attention's activations, and make only the MLP keep its input and run again in backward.

Write `recompute_mlps(model)`: change, in place, each transformer layer's MLP
(`model.layers[name].mlp`, a `minipar.model.MLP`) so that in a training step

  - the losses and the gradients are those of the model without recompute (float64, to rounding);
  - the MLP's forward runs twice per layer and micro-batch (forward, then again in backward) and
    attention's once;
  - a layer keeps for backward exactly what `planning/estimate.layer_activation_bytes` gives with
    `recompute_mlp=True`: the MLP's input and nothing inside it; attention's activations as before.

The checker counts the saved bytes with saved_tensors_hooks (chapter 0's count), the calls with
forward pre-hooks on each layer's `w_gate` and `wq`. The library's own answer
(`minipar.parallelize.recompute_mlps`, and the `_recomputed` it uses) is switched off while your
code runs; read it after you tried, with `recompute_layers` beside it.

Check: make exercise N=11.1 (one process, a few seconds)
"""

from minipar.model import Llama


def recompute_mlps(model: Llama) -> None:
    """Each layer's MLP keeps only its input and runs its forward again in backward; attention is untouched."""
    raise NotImplementedError("hint: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False) runs fn(x) "
                              "keeping only x, and fn again in backward; set each layer.mlp.forward to a function "
                              "that calls it on the MLP's own forward")
