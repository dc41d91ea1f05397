"""The run's loop, which chapter 10 reads: its configuration (`config`, `paths`), data (`data`,
`batches`, `validation`), the step and its hooks (`step`), the loop (`train`), checkpoints and logs
(`checkpoint`, `saving`, `run_log`), and its start (`launch`). The command line and every check
before a run are minipar/ops/'s; plug-ins beyond the course minipar/extras/'s.
"""
