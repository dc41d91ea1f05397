"""Exercise 8.3 (chapter 8, "Choosing a layout": the clock), predict: the compute of a step.

The planner's clock charges compute as FLOPs / (GPUs x peak x MFU). For Llama-3.1-8B (8.03 B
parameters, 32 layers, dim 4,096, vocabulary 128,256) on G H100s at 989 TFLOP/s and 45% MFU, one
step of B sequences of s tokens; `make exercise N=8.3` prints your G, B and s (drawn from SEED
below). About how many seconds of compute? A step costs about 6 FLOPs per parameter per token (2
forward, 4 backward; the input embedding is a lookup, not a matmul), plus attention's
12 x layers x dim x seq_len per token (`ModelConfig.flops_per_token`). The answer key is
`step_time` in minipar/planning/planner.py (5% tolerance).

Check: make exercise N=8.3
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # seconds of compute per optimizer step
