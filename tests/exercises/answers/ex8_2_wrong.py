"""Exercise 8.2, a plausible wrong answer: plain FSDP over the node, which does not fit at 8,192 tokens."""

ANSWER = "A"
