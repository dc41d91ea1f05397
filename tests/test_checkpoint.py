"""Checkpoints: safetensors round trip of weights and optimizer state; damage is caught by name."""

import pytest
import torch

from minipar import checkpoint
from minipar.collectives import Group
from minipar.config import TrainConfig
from minipar.model import Llama, get_config
from minipar.train import build_optimizer

SOLO = Group.solo("tp")


def whole(model, opt):
    return checkpoint.gather_full(model, checkpoint.optimizer_state(model, opt), checkpoint.hyper_params(opt), SOLO)


def trained_model():
    model = Llama(get_config("tiny"), seed=0).double()
    opt = build_optimizer(model, TrainConfig(lr=1e-2))
    x = torch.randint(0, 256, (2, 8))
    for _ in range(2):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip_restores_weights_and_adamw_state_exactly(tmp_path):
    model, opt = trained_model()
    path = checkpoint.save(tmp_path, 2, *whole(model, opt), {"step": 2, "consumed": 16})
    fresh = Llama(get_config("tiny"), seed=99).double()
    fresh_opt = build_optimizer(fresh, TrainConfig(lr=1e-2))
    state, states = checkpoint.load(checkpoint.resolve(tmp_path), fresh)
    checkpoint.set_optimizer_state(fresh, fresh_opt, states)
    assert state == {"step": 2, "consumed": 16} and path.name == "step_000002"
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), n
        for slot in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][slot], fresh_opt.state[q][slot]), (n, slot)
    # One more identical step on both: the restored optimizer continues exactly.
    x = torch.randint(0, 256, (2, 8))
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x, x).backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_damaged_checkpoints_are_named_and_resave_keeps_a_whole_copy(tmp_path):
    model, opt = trained_model()
    path = checkpoint.save(tmp_path, 5, *whole(model, opt), {"step": 5, "consumed": 0})
    # re-save in place
    checkpoint.save(tmp_path, 5, *whole(model, opt), {"step": 5, "consumed": 0})
    assert checkpoint.verify(path)["step"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["step_000005"]  # no temporary left behind

    data = (path / "optimizer.safetensors").read_bytes()
    (path / "optimizer.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(checkpoint.CheckpointError, match="is corrupt"):
        checkpoint.verify(path)
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.safetensors is missing"):
        checkpoint.verify(path)
    with pytest.raises(checkpoint.CheckpointError, match="no such folder"):
        checkpoint.resolve(tmp_path / "nope")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model, opt = trained_model()
    checkpoint.save(tmp_path, 1, *whole(model, opt), {"step": 1, "consumed": 0})
    other = Llama(get_config("tiny", dim=64, ffn_dim=128), seed=0).double()
    with pytest.raises(checkpoint.CheckpointError, match="has shape"):
        checkpoint.load(tmp_path / "step_000001", other)
