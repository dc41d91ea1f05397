"""The full 4D layout through train.py: dp2 x tp2 x pp2 x cp2 on 16 ranks (slow: `make test-slow`)."""

import pytest
from test_train import common, losses, run

pytestmark = pytest.mark.slow


def test_dp2_tp2_pp2_cp2_on_16_ranks_matches_one_process(tmp_path):
    args = dict(dtype="float64", steps=4, micro_batch=2)
    run(common(tmp_path, **args, out=tmp_path / "one", log_json=tmp_path / "one.jsonl"))
    run(common(tmp_path, **args, dp=2, tp=2, pp=2, cp=2, out=tmp_path / "4d", log_json=tmp_path / "4d.jsonl")
        + ["--sp"], nproc=16)
    one, four_d = losses(tmp_path / "one.jsonl"), losses(tmp_path / "4d.jsonl")
    assert sorted(four_d) == [1, 2, 3, 4]
    for step in one:
        assert four_d[step] == pytest.approx(one[step], rel=1e-10), step
