"""Checkpoints: safetensors round trip of weights and optimizer state; damage is caught by name."""

import os
import socket
import stat
import struct
import subprocess

import pytest
import torch
from safetensors import SafetensorError

from minipar.data_parallel import optimizer_state, param_groups, set_optimizer_state
from minipar.mesh import Groups
from minipar.model import Llama, get_config
from minipar.ops import run_folder
from minipar.parallelize import adamw
from minipar.run import checkpoint
from minipar.run.config import TrainConfig


def whole(model, opt):
    return checkpoint.gather_full(model, optimizer_state(model, opt), checkpoint.hyper_params(opt), Groups())


def trained_model():
    model = Llama(get_config("tiny"), seed=0).double()
    opt = adamw(param_groups(model, TrainConfig()), 1e-2)
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
    fresh_opt = adamw(param_groups(fresh, TrainConfig()), 1e-2)
    state, states = checkpoint.load(run_folder.resolve(tmp_path), fresh)
    set_optimizer_state(fresh, fresh_opt, states)
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


def test_damaged_checkpoints_are_named_and_a_saved_step_is_never_overwritten(tmp_path):
    model, opt = trained_model()
    path = checkpoint.save(tmp_path, 5, *whole(model, opt), {"step": 5, "consumed": 0})
    with pytest.raises(checkpoint.CheckpointError, match="step_000005 exists already"):
        checkpoint.save(tmp_path, 5, *whole(model, opt), {"step": 5, "consumed": 0})
    assert checkpoint.verify(path)["step"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["step_000005"]  # no temporary left behind

    data = (path / "optimizer.safetensors").read_bytes()
    (path / "optimizer.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(checkpoint.CheckpointError, match="is corrupt: optimizer.safetensors does not match"):
        checkpoint.verify(path)
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.safetensors is missing"):
        checkpoint.verify(path)
    with pytest.raises(checkpoint.CheckpointError, match="no such folder"):
        run_folder.resolve(tmp_path / "nope")


def tensor_data_start(path):
    """safetensors: an 8-byte little-endian header length, the JSON header, then the tensor bytes."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_a_flipped_byte_or_a_nan_in_tensor_data_is_refused_naming_the_file(tmp_path):
    model, opt = trained_model()
    path = checkpoint.save(tmp_path, 1, *whole(model, opt), {"step": 1, "consumed": 0})
    weights = path / "model.safetensors"
    original = weights.read_bytes()
    middle = (tensor_data_start(weights) + len(original)) // 2
    weights.write_bytes(original[:middle] + bytes([original[middle] ^ 1]) + original[middle + 1:])
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors does not match its checksum"):
        checkpoint.verify(path)
    weights.write_bytes(original)
    checkpoint.verify(path)
    moments = path / "optimizer.safetensors"
    data, at = bytearray(moments.read_bytes()), tensor_data_start(moments)  # float64 tensors: 8-byte aligned
    data[at:at + 8] = struct.pack("<d", float("nan"))
    moments.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.safetensors does not match its checksum"):
        checkpoint.load(path, model)


def test_a_folder_resumes_from_the_newest_checkpoint_that_verifies_and_names_those_skipped(tmp_path):
    model, opt = trained_model()
    for step in (1, 2, 10):
        checkpoint.save(tmp_path, step, *whole(model, opt), {"step": step, "consumed": 0})
    (tmp_path / "step_000010" / "model.safetensors").write_bytes(b"\x00garbage")
    skipped = []
    assert run_folder.resolve(tmp_path, skipped) == tmp_path / "step_000002"  # 10 sorts after 2 by number
    assert len(skipped) == 1 and "step_000010 is corrupt: model.safetensors" in skipped[0]
    with pytest.raises(checkpoint.CheckpointError, match="step_000010 is corrupt"):  # asked for by name
        run_folder.resolve(tmp_path / "step_000010")


def test_non_finite_weights_in_a_checkpoint_are_refused_on_load(tmp_path):
    model, opt = trained_model()
    weights, tensors, hyper = whole(model, opt)
    weights["norm.weight"][0] = float("inf")  # written so, checksum and all, by some other tool
    path = checkpoint.save(tmp_path, 1, weights, tensors, hyper, {"step": 1, "consumed": 0})
    with pytest.raises(checkpoint.CheckpointError, match="norm.weight in model.safetensors is not finite"):
        checkpoint.load(path, model)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoints_take_the_users_umask(tmp_path, umask):
    model, opt = trained_model()
    old = os.umask(umask)
    try:
        path = checkpoint.save(tmp_path / "out", 1, *whole(model, opt), {"step": 1, "consumed": 0})
    finally:
        os.umask(old)
    for folder in (tmp_path / "out", path):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask, folder
    for name in checkpoint.FILES:
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o666 & ~umask, name


def test_the_out_lock_refuses_a_live_run_and_takes_over_a_dead_ones(tmp_path):
    host = socket.gethostname()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / ".lock").write_text(f"{host} {alive.pid}")
        live = f"in use by another run \\(host {host}, pid {alive.pid}\\)"
        with pytest.raises(checkpoint.CheckpointError, match=live):
            run_folder.lock(tmp_path)
        (tmp_path / ".lock").write_text(f"another-host {os.getpid()}")  # cannot tell: refused too
        with pytest.raises(checkpoint.CheckpointError, match="host another-host"):
            run_folder.lock(tmp_path)
    finally:
        alive.kill()
        alive.wait()
    (tmp_path / ".lock").write_text(f"{host} {alive.pid}")  # now gone: a stale lock
    (tmp_path / ".tmp-minipar-123-step_000004").mkdir()  # an interrupted save
    for name in (".tmp-123-step_000004", ".tmp-minipar-x", ".tmp-minipar-1-step_4b"):  # the user's: not our form
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
    notes = run_folder.lock(tmp_path)
    assert f"took over the lock of a run that is gone (host {host}, pid {alive.pid})" in notes[0]
    assert notes[1:] == ["removed .tmp-minipar-123-step_000004, left by an interrupted save"]
    assert not (tmp_path / ".tmp-minipar-123-step_000004").exists()
    assert all((tmp_path / name / "notes.txt").read_text() == "mine"
               for name in (".tmp-123-step_000004", ".tmp-minipar-x", ".tmp-minipar-1-step_4b"))
    assert (tmp_path / ".lock").read_text() == f"{host} {os.getpid()}"
    run_folder.unlock(tmp_path)
    assert not (tmp_path / ".lock").exists()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model, opt = trained_model()
    checkpoint.save(tmp_path, 1, *whole(model, opt), {"step": 1, "consumed": 0})
    other = Llama(get_config("tiny", dim=64, ffn_dim=128), seed=0).double()
    with pytest.raises(checkpoint.CheckpointError, match="has shape"):
        checkpoint.load(tmp_path / "step_000001", other)


@pytest.mark.parametrize("text", ["", "my tool's lock\n", "host", "host pid", "a b c", "12345"])
def test_a_lock_not_in_minipars_form_is_refused_and_never_deleted(tmp_path, text):
    """Another program's .lock, or one a run has created and not yet written (microseconds): however
    old, minipar cannot tell it is its own, so it refuses, and leaves the file as it was."""
    (tmp_path / ".lock").write_text(text)
    os.utime(tmp_path / ".lock", (0, 0))  # long ago
    with pytest.raises(checkpoint.CheckpointError, match=r"holds a \.lock that is not minipar's .* never deletes it"):
        run_folder.lock(tmp_path)
    assert (tmp_path / ".lock").read_text() == text and os.stat(tmp_path / ".lock").st_mtime == 0
    run_folder.unlock(tmp_path)  # not ours: kept
    assert (tmp_path / ".lock").read_text() == text


def test_the_run_id_is_minipars_form_or_refused_and_a_new_run_replaces_only_its_own(tmp_path):
    assert run_folder.run_id(tmp_path) is None
    first = run_folder.name_run(tmp_path, None)
    assert run_folder.run_id(tmp_path) == first and len(first) == 12
    assert run_folder.name_run(tmp_path, first) == first  # resumed: kept
    assert run_folder.name_run(tmp_path, None) != first  # a new run in an --out that saved nothing
    assert [p.name for p in tmp_path.iterdir()] == ["run_id"]  # no temporary left
    (tmp_path / "run_id").write_text("my run's name")
    with pytest.raises(checkpoint.CheckpointError, match="holds a run_id that is not minipar's"):
        run_folder.name_run(tmp_path, None)
    assert (tmp_path / "run_id").read_text() == "my run's name"


# How a full disk reaches save: Python's OSError, or safetensors' own error, many lines long.
FULL_DISK = {"os": (OSError(28, "No space left on device"), "[Errno 28] No space left on device"),
             "safetensors": (SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                             'message: "No space left on device" })\n' + "  at ...\n" * 18),
                             "Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space "
                             "left on device\" })")}


@pytest.mark.parametrize("raised", FULL_DISK)
def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing_partial(tmp_path, monkeypatch, raised):
    model, opt = trained_model()
    checkpoint.save(tmp_path, 1, *whole(model, opt), {"step": 1, "consumed": 8})
    error, said = FULL_DISK[raised]

    def full(*args, **kwargs):
        raise error
    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.save(tmp_path, 2, *whole(model, opt), {"step": 2, "consumed": 16})
    assert str(e.value) == (f"cannot write the checkpoint {tmp_path / 'step_000002'} ({said}): the earlier "
                            f"checkpoints are whole; free space in {tmp_path} and resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # no temporary folder left
    assert checkpoint.verify(tmp_path / "step_000001")["step"] == 1
