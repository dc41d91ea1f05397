"""Overlapped tensor parallelism (--tp-overlap): the same step as the blocking one, bitwise, with the
same messages, and each backward message really in flight while the weight gradients are computed.

The blocking path is chapter 4's: f (enter_parallel_region), then each column layer, and f's backward
all-reduces the input gradient once autograd has run them all. The overlapped path is one autograd
node per region (autograd_ops.overlapped_columns) that posts that message and computes the weight
gradients while it travels. Both run on the same ranks from the same weights and batch.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks, tiers
from torch.utils._python_dispatch import TorchDispatchMode

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import build_grad_sync, parallelize
from minipar.run.config import TrainConfig

ROWS, SEQ = 4, 12  # 48 tokens a step; a micro-batch's 24 or 48 tokens are no width of the tiny model's weights


def batch(vocab=256):
    x = torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    return x, torch.roll(x, -1, dims=1)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it steps with, in its parameters' order."""

    def __init__(self, groups, seen: list):
        super().__init__(groups, lr=1.0)
        self.seen = seen

    def step(self, closure=None):
        self.seen += [p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None]
        return super().step(closure)


def _one_step_both_ways(rank, world, layout, micro):
    """One training step of the tiny model blocking, then overlapped, on one mesh: each step's loss,
    the gradients the optimizer saw, and the ledger of the step."""
    import minipar.run.train as train
    from minipar.run.step import micro_batches_of

    out = {}
    for overlap in (False, True):
        cfg = TrainConfig(model="tiny", seq_len=SEQ, global_batch=ROWS, micro_batch=micro, weight_decay=0.0,
                          grad_clip=0.0, tp_overlap=overlap, **layout,
                          **({} if "precision" in layout else {"dtype": "float64"}))
        with Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp) as mesh:
            _, param_dtype, autocast = train.precision(cfg, torch.device("cpu"))
            model, pipeline = train.build_model(cfg, mesh, get_config("tiny"), torch.device("cpu"), param_dtype)
            seen = []
            wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(RecordingSGD, seen=seen))
            per = ROWS // cfg.dp
            rows = tuple(t[mesh.coord("dp") * per:(mesh.coord("dp") + 1) * per] for t in batch())
            mesh.ledger.reset()
            loss, _ = train.train_step(wrapper, micro_batches_of(rows, mesh, micro, torch.device("cpu")), 0.0,
                                       autocast, pipeline=pipeline)
            out[overlap] = dict(loss=loss, grads=seen, ledger=mesh.ledger.snapshot())
    return out


LAYOUTS = [
    (2, dict(tp=2), ROWS),
    (4, dict(tp=4), ROWS),  # 2 kv heads over 4 ranks: wk and wv are ReplicatedRowsLinear
    (2, dict(tp=2, sp=True), ROWS),
    (4, dict(tp=4, sp=True), ROWS),
    (8, dict(dp=2, tp=2, pp=2), 1),
    (4, dict(tp=2, cp=2), ROWS),
    (2, dict(tp=2, sp=True, recompute=True), ROWS),  # the region's forward replayed inside backward
    (2, dict(tp=2, precision="bf16-autocast"), ROWS),  # bf16 matmuls, fp32 gradients, as the blocking path
]


@pytest.mark.parametrize("world,layout,micro", tiers(LAYOUTS, fast=2),
                         ids=["-".join(f"{k}{v}" for k, v in c[1].items()) for c in LAYOUTS])
def test_overlapped_tp_step_equals_the_blocking_one_bitwise_with_the_same_messages(world, layout, micro):
    for r in run_ranks(world, _one_step_both_ways, layout, micro, timeout=300):
        blocking, overlapped = r[False], r[True]
        assert overlapped["loss"] == blocking["loss"]  # bitwise: == on floats
        assert len(overlapped["grads"]) == len(blocking["grads"]) > 0
        for a, b in zip(blocking["grads"], overlapped["grads"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        if not layout.get("sp"):
            assert overlapped["ledger"] == blocking["ledger"]  # every op, call and byte
            continue
        # Under sp the overlapped region keeps only its [b, s/tp, h] shard of x, as Megatron does, and
        # gathers it again in backward: one more all-gather of [b, s, h] per region, nothing else.
        extra = {k: e for k, e in overlapped["ledger"].items() if blocking["ledger"].get(k) != e}
        assert list(extra) == ["tp/all_gather"]
        regions, tp = 2 * get_config("tiny").n_layers + 1, layout["tp"]  # attention and MLP per layer, the head
        bsh = ROWS * SEQ * get_config("tiny").dim * 8  # one [b, s, h] float64 activation, in bytes
        before = blocking["ledger"]["tp/all_gather"]
        assert extra["tp/all_gather"] == {"calls": before["calls"] + regions, "bytes": before["bytes"] + regions * bsh,
                                          "sent": before["sent"] + regions * bsh * (tp - 1) // tp,
                                          "intra": before["intra"] + regions * bsh * (tp - 1) // tp, "cross": 0}


# ----------------------------------------------------------------------------------------------
# The overlap happens: the order of events in one backward
# ----------------------------------------------------------------------------------------------


class Events(TorchDispatchMode):
    """Records, in order: each matmul (dW: it contracts over the tokens, dX: it has a row per token),
    each collective posted (and whether asynchronously) and each wait on an asynchronous one."""

    OPS = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.seen, self.real = tokens, [], {op: getattr(dist, op) for op in self.OPS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            a = args[0]
            self.seen.append("dW" if a.shape[1] == self.tokens else "dX" if a.shape[0] == self.tokens else "mm")
        return func(*args, **(kwargs or {}))

    def post(self, name, *args, async_op=False, **kwargs):
        self.seen.append(f"post {name}" + (" async" if async_op else ""))
        work = self.real[name](*args, async_op=async_op, **kwargs)
        return self.Waited(work, self.seen) if async_op else work

    class Waited:
        def __init__(self, work, seen):
            self.work, self.seen = work, seen

        def wait(self):
            done = self.work.wait()
            self.seen.append("wait")
            return done

    def __enter__(self):
        for op in self.OPS:
            setattr(dist, op, partial(self.post, op))
        return super().__enter__()

    def __exit__(self, *exc):
        for op, real in self.real.items():
            setattr(dist, op, real)
        return super().__exit__(*exc)


def _backward_events(rank, world, sp, overlap):
    with Mesh.build(tp=world) as mesh:
        model = parallelize(Llama(get_config("tiny"), seed=0), tp=mesh.groups().tp, sp=sp, tp_overlap=overlap).double()
        loss = model(*batch())
        with Events(tokens=ROWS * SEQ) as events:
            loss.backward()
        return [e for e in events.seen if e != "mm"]


def in_flight(seen: list[str]) -> list[list[str]]:
    """The stretches of `seen` from each asynchronous post to its wait: what ran while a message travelled."""
    stretches, open_ = [], None
    for e in seen:
        if e.endswith("async"):
            open_ = [e]
        elif open_ is not None:
            open_.append(e)
            if e == "wait":
                stretches.append(open_)
                open_ = None
    return stretches


@pytest.mark.parametrize("sp", tiers([False, True], fast=0))
def test_overlapped_backward_computes_the_weight_gradients_while_each_message_is_in_flight(sp):
    # Backward meets the head, then each layer's MLP and attention, last layer first: 1, 2, 3 column layers.
    layers = [1] + [2, 3] * get_config("tiny").n_layers
    if sp:  # x gathered again while dX is computed; dX reduce-scattered while dW is computed
        expected = [s for n in layers for s in (["post all_gather async", *["dX"] * n, "wait"],
                                                ["post reduce_scatter async", *["dW"] * n, "wait"])]
    else:  # dX's all-reduce while dW is computed
        expected = [["post all_reduce async", *["dW"] * n, "wait"] for n in layers]
    for seen in run_ranks(2, _backward_events, sp, True):
        assert in_flight(seen) == expected
    for seen in run_ranks(2, _backward_events, sp, False):  # the blocking path: each message waits for itself
        assert in_flight(seen) == [] and "wait" not in seen
        # f's backward: an all-reduce (sp: a reduce-scatter) per region; sp's g: an all-gather per region
        posts = [e for e in seen if e.startswith("post")]
        assert sorted(posts) == sorted(["post reduce_scatter", "post all_gather"] * len(layers) if sp
                                       else ["post all_reduce"] * len(layers))
