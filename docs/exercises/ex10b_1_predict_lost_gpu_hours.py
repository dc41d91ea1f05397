"""Exercise 10b.1 (chapter 10b, fault tolerance), predict: the GPU-hours a run loses to failures.

A run of G GPUs for some days, each GPU failing once per MTBF hours on average, independently
(Llama 3's 54 days on 16,384 H100s saw 419 unexpected interruptions: a GPU MTBF of about 50,700
hours). `make exercise N=10b.1` prints your G, MTBF, days, restart time, checkpoint interval and
replica-group size (drawn from SEED below). How many GPU-hours does the run expect to lose

  1. with checkpoint-restart: a failure stops every GPU of the job for the restart, and throws
     away the work done since the last checkpoint;
  2. with replica groups (torchft): a failure stops only the failed GPU's replica group (its tp x
     pp x dp GPUs) for its restart; the other groups train on, losing only the step in flight
     (seconds: leave it out)?

Work it out on paper first (how many failures; for each, how many GPUs stop, for how long), then
write the two numbers below, in GPU-hours, as a tuple (checkpoint-restart's, replica groups').
Within 1% passes. The answer key is `lost_gpu_hours` in minipar/extras/replicas.py, called once each
way: read it after you tried. Then think: at which checkpoint interval would checkpoint-restart
lose as little as your replica groups do, and what would saving that often cost?

Check: make exercise N=10b.1
"""

SEED = None  # None: drawn from your user name; any whole number picks another variant
ANSWER = None  # (GPU-hours lost with checkpoint-restart, GPU-hours lost with replica groups)
