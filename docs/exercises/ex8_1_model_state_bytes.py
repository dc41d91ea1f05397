"""Exercise 8.1 (chapter 8, "Model states: the ZeRO paper's accounting"; chapter 3), implement:
model states per rank.

Each parameter costs `weight` bytes of weights, `grad` of gradients and K = `k` of optimizer state
(mixed-precision Adam: 2 + 2 + 12; float32 Adam: 4 + 4 + 8). With psi parameters over n
data-parallel ranks, ZeRO stage 0 keeps all of it on every rank; stage 1 cuts the optimizer
state by n; stage 2 the gradients too; stage 3 the weights too. Return the bytes one rank holds.

The checker compares with the library on a grid of psi, n, stages and widths.

The library's `model_state_bytes` is switched off while the checker runs.

The library's own, after you tried: `model_state_bytes` in minipar/zero.py.

Check: make exercise N=8.1 (one process, a second)
"""


def model_state_bytes(psi: float, n: int, stage: int, weight: float = 2, grad: float = 2, k: float = 12) -> float:
    """Bytes of model states on one rank: psi parameters, n dp ranks, ZeRO `stage` (0-3)."""
    raise NotImplementedError("hint: psi * (weight / ? + grad / ? + k / ?), each divided by n from its stage on")
