"""What a run logs: wandb gets every figure the JSON log has, a resumed run continues the same
wandb run (with wandb itself, offline), peak memory on the CPU is the run's own rise, not an
earlier peak of the process (the tokenizer's), and every log line says the step's exposed
communication."""

import json
import os
import sys
import types

import pytest
import torch
from test_train import common, run

from minipar.ops import cli
from minipar.run import run_log
from minipar.run.run_log import memory_baseline, peak_memory_bytes


def leaves(value, path=""):
    """(name, value) for every number or string in a JSON record, its path joined by "/"."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, f"{path}{k}/")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}{i}/")
    else:
        yield path[:-1], value


class FakeWandb(types.SimpleNamespace):
    """Stands in for the wandb module: records what init and log are given."""

    def __init__(self):
        super().__init__(runs=[])

    def init(self, **kwargs):
        self.runs.append(types.SimpleNamespace(kwargs=kwargs, logged=[], log=None, finish=lambda: None, offline=True,
                                               settings=types.SimpleNamespace(sync_dir=f"{kwargs['dir']}/wandb/x")))
        self.runs[-1].log = lambda figures, step: self.runs[-1].logged.append((step, figures))
        return self.runs[-1]


def test_wandb_gets_every_figure_of_the_json_log_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(run_log, "peak_flops", lambda device: 1e12)  # an MFU figure on the CPU too
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    argv = [a for a in common(tmp_path, out=tmp_path / "out", log_json=tmp_path / "log.jsonl", save_every=2,
                              log_every=1) if a != "--no-wandb"]
    assert cli.main(argv + ["--steps=4"]) == 0
    assert cli.main(argv + ["--steps=6", f"--resume={tmp_path / 'out'}"]) == 0
    first, resumed = fake.runs
    run_id = (tmp_path / "out" / "wandb_run_id").read_text()
    for r in (first, resumed):
        assert (r.kwargs["id"], r.kwargs["resume"], r.kwargs["mode"]) == (run_id, "allow", "offline")
    assert resumed.kwargs["config"]["steps"] == 6 and resumed.kwargs["config"]["dim"] == 32
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert {r.pop("run_id") for r in records} == {(tmp_path / "out" / "run_id").read_text()}  # one run's records
    assert records[4] == {"step": 4, "resumed": True}  # where the second run took over: the log's own mark
    records = [r for r in records if "resumed" not in r]
    logged = first.logged + resumed.logged
    assert [step for step, _ in logged] == [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for (_, figures), record in zip(logged, records):
        expected = {name: value for name, value in leaves(record) if value is not None}
        assert figures == expected
        assert {"loss", "mfu", "bytes_sent", "sent_by_group/dp", "held_bytes/params", "held_bytes/optimizer",
                "peak_memory/0", "comm/dp/all_reduce/sent", "tokens_per_s", "comm_exposed_share"} <= figures.keys()
        assert figures["mfu"] > 0


@pytest.mark.integration
def test_a_resumed_run_continues_the_same_wandb_run_with_wandb_itself(tmp_path):
    env = {"WANDB_MODE": "offline"}
    argv = [a for a in common(tmp_path, out=tmp_path / "out", save_every=2) if a != "--no-wandb"]
    first = run(argv + ["--steps=2"], env=env)
    run(argv + ["--steps=4", f"--resume={tmp_path / 'out'}"], env=env)
    # wandb's banner and 30-line summary silenced (unless WANDB_SILENT is set): the run says where it is
    assert not [line for line in first.stderr.splitlines() if line.startswith("wandb:")], first.stderr[-2000:]
    said = [line for line in first.stdout.splitlines() if line.startswith("wandb:")]
    assert len(said) == 1 and said[0].startswith(f"wandb: offline, logged in {tmp_path / 'out' / 'wandb'}"), said
    run_id = (tmp_path / "out" / "wandb_run_id").read_text()
    runs = sorted(p.name for p in (tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs


def test_cpu_peak_memory_is_the_rise_after_the_baseline_not_an_earlier_peak():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs")
    cpu = torch.device("cpu")
    earlier = torch.ones(300 * 2**20, dtype=torch.uint8)  # 300 MiB, touched: like the tokenizer's peak
    del earlier
    assert peak_memory_bytes(cpu) > 300 * 2**20
    base = memory_baseline(cpu)
    run_tensors = torch.ones(40 * 2**20, dtype=torch.uint8)  # what the run itself adds: 40 MiB
    rise = peak_memory_bytes(cpu) - base
    assert 36 * 2**20 <= rise < 60 * 2**20, rise / 2**20  # a page or two of the baseline may be let go
    del run_tensors


def test_every_log_line_says_the_exposed_communication_after_the_bytes_sent():
    record = {"step": 3, "loss": 5.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "mfu": None,
              "peak_memory": [2**20], "bubble": None, "bytes_sent": 3 * 2**20, "expert_load": [[3, 5]],
              "sent_by_group": {"dp": 2**20, "tp": 2**21}, "comm_exposed_s": {"dp": 0.013, "tp": 0.025},
              "step_time_s": 0.12}
    line = run_log.log_line(record, 10)
    assert line.endswith("| sent 3.00 MiB/step (dp 1.00, tp 2.00 MiB) | comm exposed 38 ms of 120 ms (32%): dp 13 ms, "
                         "tp 25 ms | experts [3, 5] (max/mean 1.25)"), line
    alone = run_log.log_line({**record, "comm_exposed_s": {}, "sent_by_group": {}, "expert_load": []}, 10)
    assert alone.endswith("| comm exposed 0 ms of 120 ms (0%)"), alone  # one rank: nothing to wait on, and it says so
