"""Exercise 3.3 (chapter 3, "The memory problem"), explore: how many ranks ZeRO-3 needs.

Llama-3.1-8B in bf16 mixed precision (16 bytes per parameter of model states), one 4,096-token
sequence per rank, ZeRO-3 over dp ranks: at which dp does the fullest rank first fit in an 80 GB
H100? Run this file (a rank's peak, worked out with chapter 0's and chapter 3's tools: the model
states by `zero.model_state_bytes`, the activations by chapter 0's count of what a layer keeps,
and ZeRO-3's gathered buffers) and write the smallest dp that fits. Which part stops shrinking as
dp grows, and why?

    python docs/exercises/ex3_3_explore_zero3_dp.py

Check: make exercise N=3.3
"""

ANSWER = None  # the smallest dp of the table that fits in 80 GB

if __name__ == "__main__":
    from minipar.model import get_config
    from minipar.zero import model_state_bytes

    c, tokens, width = get_config("8b"), 4096, 2  # bf16 activations and working weights: 2 bytes
    d, heads, e, ffn = c.dim, c.n_heads, c.head_dim, c.ffn_dim
    # Chapter 0's count of what one layer keeps for backward, per token, in elements: both norms' x,
    # x/rms and normed output (6d); q after RoPE and attention's output (2d); k and v repeated to the
    # query heads (2 h e); the MLP's gate, silu(gate), up and their product (4 ffn); 1/rms of both
    # norms and attention's log-sum-exp per head (2 + h). The head: the final norm's x and x/rms, and
    # the logits in bf16 and in the loss's fp32 (chapter 0: the largest single tensor).
    per_layer = (6 * d + 2 * d + 2 * heads * e + 4 * ffn + 2 + heads) * width
    activations = tokens * (c.n_layers * per_layer + 2 * d * width + c.vocab_size * (width + 4))
    # ZeRO-3 gathers a unit whole for its forward and backward, its gradient whole until reduce-scattered:
    # the largest unit (a layer, or the [V, d] embedding or head) in bf16, weights and gradient.
    layer = 2 * d * d + 2 * d * c.n_kv_heads * e + 3 * d * ffn
    buffers = 2 * width * max(layer, c.vocab_size * d)
    for dp in (1, 2, 4, 8, 16, 32):
        states = model_state_bytes(c.num_params(), dp, stage=3)  # 2 + 2 + 12 bytes a parameter, all cut by dp
        print(f"dp {dp:>2}: peak {(states + activations + buffers) / 1e9:6.1f} GB (model states "
              f"{states / 1e9:6.1f} GB, activations {activations / 1e9:5.1f} GB, gathered {buffers / 1e9:4.1f} GB)")
