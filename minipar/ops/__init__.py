"""The operating tier: what protects a run and its user rather than what the course teaches: the
command line of scripts/train.py with all its checks (cli.py) and torchrun's agent inside it
(agent.py). Chapter 10 reads it; a first reading skips it. Nothing in minipar/run/ imports it."""
