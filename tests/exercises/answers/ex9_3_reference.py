"""Exercise 9.3, the mesh's answer: only pp, the slowest-varying dimension, spans 16 ranks."""

ANSWER = ["pp"]
