"""The run's plumbing around the course: the training loop (`train`), how it starts (`launch`),
its configuration (`config`, `config_file`, `preflight`), data (`data`, `batches`, `validation`),
checkpoints and logs (`checkpoint`, `run_log`), and the bridge to other tools (`hf`, `generate`).
The parallelisms themselves live one level up, in `minipar/`."""
