"""The run's loop, which chapter 10 reads: its configuration (`config`, `flags`, `config_file`,
`args`), data (`data`, `batches`, `validation`), the step and its hooks (`step`), the loop (`train`),
checkpoints and logs (`checkpoint`, `checkpoint_checks`, `saving`, `run_log`, `profiling`), and its
start (`launch`, `hang`). The command line and its checks are minipar/ops/'s; plug-ins beyond the
course minipar/extras/'s. The parallelisms themselves live one level up, in `minipar/`."""
