"""Exercise 6.4, the planner's pipeline_idle (the simulated schedule), searched."""

from minipar.planning.planner import pipeline_idle

ANSWER = next(m for m in range(1, 100) if pipeline_idle("1f1b", 4, m) < 0.10)
