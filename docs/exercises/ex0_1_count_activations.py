"""Exercise 0.1 (chapter 0, "Where one step's memory goes"), implement: count the activations.

A forward pass keeps tensors for the backward pass: a matmul keeps its input, a norm its input, a
softmax its output. Count them. Run the model's forward, `model(tokens[:, :-1], tokens[:, 1:])`
(it returns the loss), inside `torch.autograd.graph.saved_tensors_hooks(pack, unpack)`: autograd
calls pack(t) for every tensor it saves. Return the bytes of what was saved:

  - each storage once (several saved tensors can be views of one storage:
    `t.untyped_storage().data_ptr()` names it, `.nbytes()` sizes it);
  - not the model's weights (they are held anyway; they are not activations).

The checker compares your count with the estimator (planning/estimate.py's `activation_bytes`),
which works it out from the shapes alone, on the tiny model at two shapes (within 1%: it leaves
out a few small tensors).

The estimator's `activation_bytes` is switched off while the checker runs your code: count, don't
look up.

The library's own, after you tried: `kept_for_backward` in scripts/course/step_00_one_device.py.

Check: make exercise N=0.1 (one process, a few seconds)
"""

import torch
from torch import nn


def saved_activation_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one forward of `model` on tokens [b, s+1]; weights excluded."""
    raise NotImplementedError("hint: weights = {p.untyped_storage().data_ptr() for p in model.parameters()}; "
                              "in pack(t), remember t's storage pointer and nbytes in a dict, return t")
