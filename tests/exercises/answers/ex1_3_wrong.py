"""Exercise 1.3, a plausible wrong answer: the latency of a whole call (160 µs) charged once per
ring step, which counts it twice and doubles the time sooner."""

ANSWER = (4, 17)
