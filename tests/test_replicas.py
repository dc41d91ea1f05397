"""Replica groups on torchft (minipar/extras/replicas.py, scripts/train_ft.py): a lost group costs the
survivor no step, a returning group takes the survivor's state bitwise (nothing read from disk),
and without a kill the run is minipar's plain data parallelism with the same global batch."""

import copy
import importlib.util
import json
import os
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minipar.extras import replicas
from minipar.extras.replicas import Replicas, persistent
from minipar.ops.command_line import parse_args
from minipar.run.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_ft", ROOT / "scripts" / "train_ft.py")
train_ft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_ft)
KILLS = sorted(random.Random(31).sample(range(4, 40), 3))  # three different steps of group 1's


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    return {**load_file(folder / "model.safetensors"), **load_file(folder / "optimizer.safetensors")}


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Two groups of one rank, 600 steps; group 1 killed at KILLS, its first restart killed again
    while it applies the state it took."""
    out = tmp_path_factory.mktemp("ft") / "run"
    assert train_ft.main(["--steps=600", f"--kill-at={','.join(map(str, KILLS))}", "--kill-in-transfer",
                          f"--out={out}"]) == 0
    return out


def test_the_survivor_never_stops_and_never_goes_back(killed):
    steps = [r["step"] for r in records(killed / "group0_attempt1.jsonl")]
    assert steps == list(range(1, 601))  # one record a step: none lost, none repeated
    taking_part = [r["replica_groups"] for r in records(killed / "group0_attempt1.jsonl")]
    assert taking_part[0] == 2 and taking_part.count(1) > 0 and set(taking_part) == {1, 2}  # the log knows
    log = (killed / "group0_attempt1.log").read_text()
    assert "1 of 2 replica groups take part" in log and "resumed" not in log


def test_group_1_was_killed_at_three_steps_and_once_during_its_transfer(killed):
    attempts = sorted(killed.glob("group1_attempt*.log"))
    assert len(attempts) == 5  # the first, the one killed in transfer, and one after each later kill
    half = attempts[1].read_text()
    assert "is applying a peer's state" in half and "applied it" not in half  # killed half-way
    finished = [a for a in attempts if (a.parent / f"{a.stem}.jsonl").exists() and records(a.with_suffix(".jsonl"))]
    last_steps = [records(a.with_suffix(".jsonl"))[-1]["step"] for a in finished[:-1]]
    assert len(set(last_steps)) == 3 and all(s >= k for s, k in zip(last_steps, KILLS))


def test_a_restarted_group_takes_the_survivors_state_bitwise_and_nothing_from_disk(killed):
    sent = dict(re.findall(r"step (\d+): replica group 0 sends its state to a returning group: [\d,]+ bytes, "
                           r"digest (\w+)", (killed / "group0_attempt1.log").read_text()))
    for attempt in (3, 4, 5):
        log = (killed / f"group1_attempt{attempt}.log").read_text()
        step, got = re.search(r"step (\d+): replica group 1 applied it: digest (\w+)", log).groups()
        assert sent[step] == got, (attempt, step)  # every byte of weights and AdamW state, as group 0 sent them
        assert f"took its state from group 0: step {int(step) - 1}" in log and "resumed" not in log
        first = records(killed / f"group1_attempt{attempt}.jsonl")[0]["step"]
        assert first == int(step)  # it trains the step it joined at: no wait, no step skipped
    end = "step_000600"
    assert bitwise_equal(checkpoint(killed / "group0_attempt1" / end), checkpoint(killed / "group1_attempt5" / end))


def test_without_a_kill_two_groups_are_plain_data_parallelism_bitwise(tmp_path):
    """dp 1 in each group: the mean (a + b) / 2 is what dp 2's all-reduce gives, a / 2 + b / 2, to the
    bit (halving is exact), and the rows, the loss divisor and AdamW are the same."""
    assert train_ft.main(["--steps=6", "--kill-at=", f"--out={tmp_path / 'ft'}"]) == 0
    from test_train import run
    run([*train_ft.RUN, "--steps=6", "--dp=2", f"--out={tmp_path / 'dp'}"], nproc=2)
    dp = checkpoint(tmp_path / "dp" / "step_000006")
    for g in (0, 1):
        assert bitwise_equal(checkpoint(tmp_path / "ft" / f"group{g}_attempt1" / "step_000006"), dp)


@pytest.mark.integration
def test_groups_of_two_ranks_equal_plain_dp_4_and_survive_a_kill(tmp_path):
    """dp 2 inside each group: the mean of the groups' means, ((a + b)/2 + (c + d)/2)/2, rounds in
    another order than dp 4's ring all-reduce: the mean gradient differs by a rounding or two, ~1e-16
    of its norm. AdamW's m / sqrt(v) turns that into a few 1e-15 of each tensor's norm (measured: 4.4e-15
    after one step, 2.7e-15 after 6); 1e-14 bounds it. Element by element, an AdamW moment near 0
    differs relatively more, so the bound is on norms."""
    assert train_ft.main(["--steps=6", "--kill-at=", "--nproc-per-group=2", "--dp=2", f"--out={tmp_path / 'ft'}"]) == 0
    from test_train import run
    run([*train_ft.RUN, "--steps=6", "--dp=4", f"--out={tmp_path / 'dp'}"], nproc=4)
    dp = checkpoint(tmp_path / "dp" / "step_000006")
    for g in (0, 1):
        ft = checkpoint(tmp_path / "ft" / f"group{g}_attempt1" / "step_000006")
        for k in dp:
            assert (ft[k] - dp[k]).norm() <= 1e-14 * dp[k].norm(), k
    out = tmp_path / "killed"
    assert train_ft.main(["--steps=1500", "--kill-at=5", "--nproc-per-group=2", "--dp=2", f"--out={out}"]) == 0
    assert [r["step"] for r in records(out / "group0_attempt1.jsonl")] == list(range(1, 1501))
    assert "took its state from group 0" in (out / "group1_attempt2.log").read_text()



@pytest.mark.integration
def test_experts_inside_groups_equal_plain_dp_4_with_ep_2(tmp_path):
    """ep 2 inside each group of two ranks (edp 1): each rank's experts are the same experts as its
    peer's in the other group, so the cross-group mean of their gradients is edp 2's of plain dp 4 x
    ep 2, in another order of rounding, as above (measured: 1.2e-15 of each tensor's norm)."""
    moe = ["--", "--model=tiny-moe", "--ep=2"]
    assert train_ft.main(["--steps=6", "--kill-at=", "--nproc-per-group=2", "--dp=2", f"--out={tmp_path / 'ft'}",
                          *moe]) == 0
    from test_train import run
    run([*train_ft.RUN, "--steps=6", "--dp=4", *moe[1:], f"--out={tmp_path / 'dp'}"], nproc=4)
    dp = checkpoint(tmp_path / "dp" / "step_000006")
    assert any("experts" in k for k in dp)
    for g in (0, 1):
        ft = checkpoint(tmp_path / "ft" / f"group{g}_attempt1" / "step_000006")
        assert ft.keys() == dp.keys()
        for k in dp:
            assert (ft[k] - dp[k]).norm() <= 1e-14 * dp[k].norm(), k

# -- groups that do not start alike: they agree before they average, or the run stops ------------
def start_groups(folder: Path, flags: list[list[str]], steps: int = 6) -> list:
    """One replica group of one rank for each of `flags` (train_ft's RUN with those flags added), all
    started at once against a lighthouse in this process; returns them ended."""
    from torchft.coordination import LighthouseServer
    os.environ["RUST_LOG"] = os.environ.get("RUST_LOG") or "error"  # the lighthouse's INFO line for each quorum
    port = train_ft.free_port()
    lighthouse = LighthouseServer(bind=f"[::]:{port}", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    argv = [*train_ft.RUN, f"--steps={steps}", "--log-every=1", f"--replica-groups={len(flags)}",
            f"--lighthouse=localhost:{port}"]
    folder.mkdir(parents=True, exist_ok=True)
    groups = [train_ft.Group(g, [*argv, f"--replica-group-id={g}", *more], folder, 1) for g, more in enumerate(flags)]
    try:
        for group in groups:
            group.start()
        for group in groups:
            group.proc.wait(timeout=120)
    finally:
        for group in groups:
            if group.proc.poll() is None:
                group.kill()
        lighthouse.shutdown()
    return groups


def refusal(group) -> str:
    """The group's one error line (exit 3, no traceback)."""
    text = group.text()
    assert group.proc.returncode == 3 and "Traceback" not in text and text.count("minipar: error:") == 1, text[-2000:]
    return next(line for line in text.splitlines() if "minipar: error:" in line)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two groups, 6 steps, saved at step 4 and 6: the run the others are measured against."""
    out = tmp_path_factory.mktemp("ft_ref")
    assert [g.proc.returncode for g in start_groups(out, [["--save-every=4"]] * 2)] == [0, 0]
    return out


@pytest.mark.integration
def test_a_resumed_group_and_a_new_one_end_as_one_uninterrupted_run(uninterrupted, tmp_path):
    """Group 0 resumes step 4 of the run above, group 1 starts new: torchft's step is minipar's, so
    the heal sees group 1 behind and it takes group 0's state; steps 5 and 6 are the run's, bitwise."""
    resume = f"--resume={uninterrupted / 'group0_attempt1' / 'step_000004'}"
    groups = start_groups(tmp_path, [[resume], []])
    assert [g.proc.returncode for g in groups] == [0, 0], groups[1].text()[-3000:]
    assert "replica group 1 took its state from group 0: step 4" in groups[1].text()
    end = checkpoint(uninterrupted / "group0_attempt1" / "step_000006")
    for g in (0, 1):
        assert bitwise_equal(checkpoint(tmp_path / f"group{g}_attempt1" / "step_000006"), end)
        losses = [(r["step"], r["loss"]) for r in records(tmp_path / f"group{g}_attempt1.jsonl") if "loss" in r]
        assert losses == [(r["step"], r["loss"]) for r in records(uninterrupted / "group0_attempt1.jsonl")
                          if r["step"] > 4 and "loss" in r]


def test_groups_with_different_flags_are_refused_in_one_line(tmp_path):
    for group in start_groups(tmp_path, [[], ["--lr=2e-2", "--seed=3"]], steps=2):
        assert refusal(group).endswith("replica groups disagree on their settings, against group 0's: group 1's "
                                       "--lr, --seed; give every group the same flags (each has its own "
                                       "--replica-group-id, --out, --log-json, --resume)")
        assert not (tmp_path / f"group{group.g}_attempt1.jsonl").exists()  # no step was taken


@pytest.mark.integration
def test_groups_of_other_models_are_refused_in_one_line_even_after_a_heal(uninterrupted, tmp_path):
    """Both new: nothing to heal. One resumed: the new one's heal finds a state that does not fit."""
    resume = f"--resume={uninterrupted / 'group0_attempt1' / 'step_000004'}"
    for first in ([], [resume]):
        for group in start_groups(tmp_path / str(len(first)), [first, ["--dim=64"]]):
            assert "settings, against group 0's: group 1's --dim;" in refusal(group)


@pytest.mark.integration
def test_groups_at_one_step_with_other_weights_are_refused_in_one_line(uninterrupted, tmp_path):
    """Both new, one starting from the weights of another run's step 4 (--init-from): same settings,
    same step 0, other weights; nothing to heal, so the run stops."""
    init = f"--init-from={uninterrupted / 'group0_attempt1' / 'step_000004'}"
    for group in start_groups(tmp_path, [[], [init]]):
        assert "different weights at the same step 0, against group 0's: group 1 (a digest" in refusal(group)


# -- what every gradient-sync wrapper gives the replica groups, on 2 gloo ranks --------------------
def _wrapper(zero: int, groups, seed: int = 1):
    from test_data_parallel import OPT

    from minipar.data_parallel import param_groups
    from minipar.model import Llama, get_config
    from minipar.parallelize import adamw, build_grad_sync
    model = Llama(get_config("tiny"), seed=seed).double()
    return build_grad_sync(model, groups, param_groups(model, OPT), lambda pgs: adamw(pgs, OPT.lr), zero=zero,
                           bucket_mb=0.02)


def _protocol(rank, world, zero):
    """The gate sees the whole gradient (or this rank's slices of it), a gate that says no leaves no
    trace, and persistent() with the optimizer's state_dict is all a rank needs to become another
    (what a returning group takes)."""
    from test_data_parallel import global_batch

    from minipar.collectives import all_reduce
    from minipar.mesh import Mesh
    from minipar.run.train import train_step
    with Mesh.build(dp=world) as mesh:
        groups = mesh.groups()
        rows = [tuple(t[rank * 4:(rank + 1) * 4] for t in global_batch(step)) for step in range(3)]
        a, same, plain = _wrapper(zero, groups), _wrapper(zero, groups), _wrapper(0, groups)
        seen: dict[str, torch.Tensor] = {}

        def refused(name):  # a gate that notes the square norm of what it is shown, and says no
            def gate(grads):
                seen[name] = sum(g.pow(2).sum() for g in grads).reshape(1)
                return False
            return gate
        for name, model in (("a", a), ("plain", plain)):  # `same` never sees this try
            model(*rows[0], 1.0).backward()
            model.finish_grad_sync()
            assert model.clip_and_step(1.0, None, refused(name)) is None  # not committed: nothing stepped
        norm2 = seen["a"]
        if zero:  # each rank holds a slice: the whole gradient's square norm is their sum
            all_reduce(norm2, groups.dp)
        whole = seen["plain"]
        for model in (a, same):  # the try a's gate refused must be as if it never was
            train_step(model, [rows[1]], grad_clip=1.0)
        bitwise = lambda x, y: all(torch.equal(s, t) for s, t in zip(persistent(x), persistent(y)))  # noqa: E731
        dropped_is_gone = bitwise(a, same) and str(a.optimizer.state_dict()) == str(same.optimizer.state_dict())
        b = _wrapper(zero, groups, seed=2)  # another start: it takes a's state as a returning group does
        with torch.no_grad():
            for mine, theirs in zip(persistent(b), persistent(a)):
                mine.copy_(theirs)
        b.optimizer.load_state_dict(copy.deepcopy(a.optimizer.state_dict()))  # a copy, as the transfer's is
        for model in (a, b):
            train_step(model, [rows[2]], grad_clip=1.0)
        handed_over = bitwise(a, b) and not bitwise(a, _wrapper(zero, groups, seed=2))  # b was another model
        return float(norm2), float(whole), dropped_is_gone, handed_over


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_each_wrapper_gives_the_whole_gradient_drops_a_try_and_hands_over_its_state(zero):
    from harness import run_ranks
    for norm2, whole, dropped_is_gone, handed_over in run_ranks(2, _protocol, zero):
        assert norm2 == pytest.approx(whole, rel=1e-12)  # float64: slices vs whole, summed in another order
        assert dropped_is_gone and handed_over


# -- the pieces, in this process ----------------------------------------------------------------
def test_replica_flags_are_checked_in_one_line():
    base = ["--model=tiny", "--vocab-size=512", "--global-batch=8", "--micro-batch=2"]
    for flags, says in ((["--replica-groups=2"], "needs --lighthouse HOST:PORT"),
                        (["--lighthouse=h:1"], "acts only with --replica-groups 2 or more"),
                        (["--replica-groups=2", "--replica-group-id=2", "--lighthouse=h:1"], "give 0 to"),
                        (["--replica-groups=3", "--lighthouse=h:1"], "not divisible by --replica-groups 3"),
                        (["--replica-groups=0"], "give 1 (none) to 1024")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            replicas.check(parse_args([*base, *flags]))  # the ranges parse_args's, the rest the plug-in's


class _Rows:
    """A stand-in for TokenData whose rows say which slot of how many they are."""

    def rank_batch(self, consumed, global_batch, slot, slots):
        per = global_batch // slots
        rows = torch.arange(slot * per, (slot + 1) * per).reshape(-1, 1) + consumed
        return rows, rows


@pytest.mark.parametrize("groups,dp", [(2, 1), (3, 2), (4, 1)])
def test_the_groups_taking_part_share_every_slot_of_the_global_batch_once(groups, dp):
    for size in range(1, groups + 1):
        seen = []
        for index in range(size):
            seat = Replicas.__new__(Replicas)
            seat.groups, seat.size, seat.index = groups, size, index
            for coord in range(dp):
                seen += seat.rows(_Rows(), 100, 12 * groups * dp, dp, coord)[0].reshape(-1).tolist()
        assert sorted(seen) == list(range(100, 100 + 12 * groups * dp)), (size, seen)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
