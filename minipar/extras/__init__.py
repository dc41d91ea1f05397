"""Beyond the course: capabilities a real run wants that the chapters do not need, each plugged
in from outside the loop (minipar/run/ imports nothing from here). replicas.py: fault tolerance
on torchft (chapter 10b), through the loop's step hooks; hf.py: Hugging Face checkpoints both ways
(scripts/tools/convert.py); generate.py: sampling with a KV cache (scripts/tools/sample.py, scripts/tools/eval.py)."""
