"""The run's plumbing around the course: the training loop (`train`, `step`), how it starts and
stops (`launch`, `hang`), its configuration (`args`, `config`, `config_file`, `preflight`), data
(`data`, `batches`, `validation`), checkpoints and logs (`checkpoint`, `checkpoint_checks`,
`saving`, `run_log`), and the bridge to other tools (`hf`, `generate`).
The parallelisms themselves live one level up, in `minipar/`."""
