"""Every message is in a ledger: a whole run of gloo ranks, from building the mesh through a
training step to a checkpoint save (its waits, its gather of the pipeline stages), asks
torch.distributed for exactly the calls and bytes the ledgers hold.

The count on the torch side is taken at the call boundary, independently of the ledger: each
communication function of torch.distributed is wrapped for the test and adds up the bytes of the
tensors it is handed (for an all-gather its output, for a reduce-scatter its input, as the ledger
defines the payload). Any other function (gather_object, all_gather_object, ...) is counted under
its own name, which no ledger holds: a message sent around collectives.py fails the test.

The same run checks the clock of exposed communication (comm_clock.py, which RunLog sets on the
mesh's ledger): every group of more than one rank that the ledger saw traffic on was also timed,
and no other, so a wait the clock missed would leave its group out of the training log's figure.
"""

from contextlib import contextmanager, nullcontext
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import get_config
from minipar.parallelize import adamw, build_grad_sync
from minipar.run.config import TrainConfig


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch.distributed function -> (the ledger's name for it, the payload of one call)
PAYLOAD = {
    "all_reduce": ("all_reduce", lambda tensor, *a, **k: _bytes(tensor)),
    "all_gather": ("all_gather", lambda tensor_list, tensor, *a, **k: sum(map(_bytes, tensor_list))),
    "reduce_scatter": ("reduce_scatter", lambda output, input_list, *a, **k: sum(map(_bytes, input_list))),
    "broadcast": ("broadcast", lambda tensor, *a, **k: _bytes(tensor)),
    "all_to_all_single": ("all_to_all", lambda output, input, *a, **k: _bytes(input)),
    "send": ("send", lambda tensor, *a, **k: _bytes(tensor)),
    "isend": ("send", lambda tensor, *a, **k: _bytes(tensor)),
    "recv": ("recv", lambda tensor, *a, **k: _bytes(tensor)),
    "irecv": ("recv", lambda tensor, *a, **k: _bytes(tensor)),
    "gather": ("gather", lambda tensor, *a, **k: _bytes(tensor)),
    "barrier": ("barrier", lambda *a, **k: 0),
}
UNCOUNTED = ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list", "scatter",
             "reduce", "all_to_all", "all_gather_into_tensor", "reduce_scatter_tensor", "monitored_barrier")


@contextmanager
def torch_side_count():
    """{op: [calls, payload bytes]} of every call into torch.distributed's communication functions."""
    count: dict[str, list[int]] = {}
    saved = {name: getattr(dist, name) for name in (*PAYLOAD, *UNCOUNTED, "P2POp", "batch_isend_irecv")}

    def note(op: str, nbytes: int) -> None:
        entry = count.setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += nbytes

    def counted(name):
        op, payload = PAYLOAD.get(name, (name, lambda *a, **k: 0))

        def call(*args, **kwargs):
            note(op, payload(*args, **kwargs))
            return saved[name](*args, **kwargs)
        call.original = saved[name]
        return call

    def batch(ops):  # the point-to-point operations of a ring hop, each counted
        for p2p in ops:
            note("send" if p2p.op is saved["isend"] else "recv", _bytes(p2p.tensor))
        return saved["batch_isend_irecv"](ops)

    try:
        for name in (*PAYLOAD, *UNCOUNTED):
            setattr(dist, name, counted(name))
        # P2POp accepts only torch's own isend/irecv: hand it those, uncounted (batch counts them)
        dist.P2POp = lambda op, *args, **kwargs: saved["P2POp"](getattr(op, "original", op), *args, **kwargs)
        dist.batch_isend_irecv = batch
        yield count
    finally:  # the worker processes run other tests afterwards
        for name, fn in saved.items():
            setattr(dist, name, fn)


def ledger_side_count(ledgers_and_sizes) -> dict[str, list[int]]:
    """{op: [calls, payload bytes]} over the ledgers' groups of more than one rank (a group of one
    writes its line but sends nothing)."""
    count: dict[str, list[int]] = {}
    for ledger, sizes in ledgers_and_sizes:
        for (group, op), e in ledger.entries.items():
            if sizes[group] > 1:
                entry = count.setdefault(op, [0, 0])
                entry[0] += e.calls
                entry[1] += e.bytes
    return count


def _step_and_save(rank, world, layout, out):
    import minipar.run.train as train
    from minipar.context_parallel import split_sequence
    from minipar.run import saving
    from minipar.run.run_log import RunLog

    cfg = TrainConfig(model="tiny", seq_len=16, global_batch=8, micro_batch=2, dtype="float64", out=str(out),
                      wandb=False, **layout)
    with torch_side_count() as sent:
        mesh = Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp)
        log = RunLog(cfg, mesh, torch.device("cpu"))  # its own group and ledger: the save's waits
        model, pipeline = train.build_model(cfg, mesh, get_config("tiny"), torch.device("cpu"), torch.float64)
        wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr),
                                  zero=cfg.zero, bucket_mb=0.01)
        x = torch.randint(0, 256, (cfg.global_batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
        per = cfg.global_batch // cfg.dp
        x = x[mesh.coord("dp") * per:(mesh.coord("dp") + 1) * per]
        x, y = split_sequence(x[:, :-1], mesh.groups().cp), split_sequence(x[:, 1:], mesh.groups().cp)
        micro = list(zip(x.split(cfg.micro_batch), y.split(cfg.micro_batch)))
        train.train_step(wrapper, micro, cfg.grad_clip, nullcontext, pipeline)
        saving.save(cfg, 1, cfg.global_batch, wrapper, mesh, log, SimpleNamespace(fingerprint="test",
                                                                                  tokenizer_file=None))
    groups = [mesh.group(d) for d in ("dp", "tp", "pp", "cp")] + [mesh.groups().dp_cp, mesh.group("pp", channel="grad")]
    sizes = {g.name: g.size for g in groups}
    counted = ledger_side_count([(mesh.ledger, sizes), (log.group.ledger, {"log": log.group.size})])
    talked = {group for group, _op in mesh.ledger.entries if sizes[group] > 1}
    mesh.destroy()
    return counted, sent, (talked, log.clock.seconds())


@pytest.mark.parametrize("layout", [dict(dp=2, pp=2, zero=1), dict(tp=2, cp=2, sp=True, tp_overlap=True, zero=3)],
                         ids=["dp2-pp2-zero1", "tp2-cp2-sp-overlap-zero3"])
def test_a_step_and_a_save_send_exactly_what_the_ledgers_hold(layout, tmp_path):
    for rank, (ledgers, sent, (talked, timed)) in enumerate(run_ranks(4, _step_and_save, layout, tmp_path,
                                                                        timeout=300)):
        assert ledgers == sent, f"rank {rank}: ledgers {ledgers}, torch.distributed {sent}"
        assert set(timed) == talked and all(seconds > 0 for seconds in timed.values()), (rank, talked, timed)
        assert "all_reduce" in sent  # the save's check of the weights, and its wait for rank 0's write
        if layout.get("pp"):
            assert "gather" in sent and "send" in sent  # the stages' weights; the pipeline's activations
    assert (tmp_path / "step_000001" / "model.safetensors").exists()
