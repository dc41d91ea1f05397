"""Step 7: expert parallelism, seen from every rank: where each token goes, what crosses, what it saves.

    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_07_expert_parallel.py    (2 works too)

All ranks form one dp group, carved into ep = world (edp = 1): rank r holds experts r*E/ep ..
(r+1)*E/ep - 1 of every MoE layer. Everything is float64 and compared with the plain MoE layer.

(a) routing: each rank draws a few tokens; the router (the same weights everywhere) gives each its
    top-k experts and their weights, and the rank holding each chosen expert;
(b) dispatch: the tokens sent per rank pair (rows: from, columns: to), the ledger's ep/all_to_all
    bytes against the formula, and the expert-parallel layer's output and every gradient against
    the plain layer's (experts: against the dp average of the plain layer's gradients);
(c) load balance: a layer trained from a skewed router with the load-balancing loss off and on:
    the busiest expert's load over the mean, step by step, and what a capacity factor would drop;
(d) memory and traffic per rank for the tiny-moe model, experts cut over ep = world against
    experts replicated (ep 1, plain data parallelism): expert bytes held, bytes sent in one step,
    measured and by formula; then the same formulas at Mixtral-8x7B's shapes;
(e) where the all-to-alls sit in a training step: the collectives one step posts, in order (the
    ledger's trace), summarised, and checked against NCCL's ordering rules.

Chapter: docs/07_expert_parallel.md.
"""

import copy
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from course_common import each_rank, finish, leave, say, start_gloo, to_rank0

from minipar.collectives import all_reduce
from minipar.data_parallel import param_groups
from minipar.expert_parallel import parallelize_experts
from minipar.mesh import Mesh
from minipar.model import get_config, init_weights
from minipar.moe import MoE, take_load
from minipar.order_check import order_problems
from minipar.parallelize import adamw, build_grad_sync
from minipar.run.config import TrainConfig
from minipar.run.train import build_model, train_step

E, K, DIM, FFN = 8, 2, 8, 8  # the layer of (a)-(c): 8 experts, top-2, d = 8
TOKENS = 4  # per rank, in (a) and (b)
LAYER = get_config("tiny-moe", dim=DIM, n_heads=2, n_kv_heads=2, n_experts=E, top_k=K, expert_ffn_dim=FFN)
SEQ = 16  # (d), (e): the tiny-moe model, 2 rows of 16 tokens per rank, one row per micro-batch


def plain_layer() -> MoE:
    moe = MoE(LAYER).double()
    init_weights(moe, LAYER, seed=3)
    return moe


def draw(rank: int, n: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(n, DIM, generator=g, dtype=torch.float64) + shift


def part_a(ep) -> torch.Tensor:
    n = E // ep.size
    x = draw(ep.rank, TOKENS, seed=1)
    with torch.no_grad():
        weights, chosen = plain_layer().probabilities(x).topk(K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    say(f"(a) one MoE layer: E = {E} experts (SwiGLU, d {DIM}, ffn {FFN}), top-{K}, softmax router; ep = {ep.size}:\n  "
        + "   ".join(f"rank {r} holds " + " ".join(f"e{e}" for e in range(r * n, (r + 1) * n)) for r in range(ep.size)))
    lines = to_rank0([f"token {t}: " + "   ".join(f"e{int(e)} {float(w):.3f} (rank {int(e) // n})"
                                                 for e, w in zip(chosen[t], weights[t])) for t in range(TOKENS)])
    if lines is not None:
        print(f"  each rank draws {TOKENS} tokens of its own; each token's {K} experts, weight and holder:")
        print("\n".join(f"  rank {r} {line}" for r, rank_lines in enumerate(lines) for line in rank_lines))
    return chosen


def part_b(mesh: Mesh, ep, chosen: torch.Tensor) -> None:
    n, world, me = E // ep.size, ep.size, ep.rank
    matrix = torch.zeros(world, world, dtype=torch.long)
    matrix[me] = torch.bincount(chosen.flatten() // n, minlength=world)  # to the rank holding each expert
    dist.all_reduce(matrix)  # every rank's row (bookkeeping for the printout: not in the ledger)
    rows_out, rows_in = int(matrix[me].sum() - matrix[me, me]), int(matrix[:, me].sum() - matrix[me, me])
    say("\n(b) assignments sent per rank pair (row: from, column: to; the diagonal stays home)\n         "
        + "".join(f"to {j:<4}" for j in range(world)))
    say("\n".join(f"  from {i} " + "".join(f"{int(c):<7}" for c in matrix[i]) for i in range(world)))
    plain, w = plain_layer(), draw(me, TOKENS, seed=2)
    layer = copy.deepcopy(plain)
    parallelize_experts(layer, ep, None, None, sp=False)
    mesh.ledger.reset()
    x_ep, x = (draw(me, TOKENS, seed=1).requires_grad_() for _ in range(2))
    y_ep = layer(x_ep)
    (y_ep * w).sum().backward()
    a2a, formula = mesh.ledger.get("ep", "all_to_all"), (world - 1) * n * 8 + 2 * (rows_out + rows_in) * DIM * 8
    each_rank("  ledger ep/all_to_all per rank: calls, bytes sent = counts (ep-1) E/ep x 8 + 2 (rows out + rows in)"
              " x d x 8", f"{a2a.calls} calls, {a2a.sent:>5,} B = {(world - 1) * n * 8} + 2 x ({rows_out} + "
              f"{rows_in}) x {DIM} x 8 = {formula:,}: {a2a.sent == formula}")
    y = plain(x)
    (y * w).sum().backward()
    for p in plain.experts.parameters():  # what data parallelism gives a replicated expert: the dp mean
        dist.all_reduce(p.grad)
        p.grad /= world
    pairs = [(y_ep, y), (x_ep.grad, x.grad), (layer.router.weight.grad, plain.router.weight.grad)]
    pairs += [(getattr(layer.experts, k).grad, getattr(plain.experts, k).grad[me * n:(me + 1) * n])
              for k in ("w_gate", "w_up", "w_down")]
    each_rank("  max |expert-parallel - plain| of y, dx, d router, and d w_gate, d w_up, d w_down of the experts "
              "held (plain: the dp mean)", "  ".join(f"{float((a - b).detach().abs().max()):.1e}" for a, b in pairs))


def train_layer(mesh: Mesh, ep, coef: float, steps: int, every: int) -> list[tuple]:
    """A layer from a skewed router, trained to imitate a random map; every `every` steps: the load
    per expert over those steps (all ranks), what a capacity factor of 1.25 would drop, the loss."""
    dp, layer = mesh.groups().dp, plain_layer()
    layer.aux_loss_coef = coef
    with torch.no_grad():
        layer.router.weight[:K] += 0.2  # tokens share a mean along (1, ..., 1): experts 0 and 1 win
    parallelize_experts(layer, ep, None, None, sp=False)
    target = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64) / DIM ** 0.5
    opt = torch.optim.Adam(layer.parameters(), lr=0.01)
    out, load = [], torch.zeros(E, dtype=torch.long)
    for step in range(steps):
        x = draw(ep.rank, 128 // dp.size, seed=10 + step, shift=0.5)  # 128 tokens a step over all ranks
        loss = F.mse_loss(layer(x), torch.tanh(x @ target))
        loss.backward()
        all_reduce(layer.router.weight.grad, dp)  # dense: averaged over dp; experts: already (the /ep hook)
        layer.router.weight.grad /= dp.size
        load += torch.tensor(take_load(layer)[0])
        if step == 0 or (step + 1) % every == 0:
            all_reduce(load, dp)  # every rank's assignments
            with torch.no_grad():
                flat = layer.probabilities(x).topk(K, dim=-1).indices.flatten()
            layer.capacity_factor = 1.25
            dropped = 1 - float(layer.within_capacity(flat).double().mean())
            layer.capacity_factor = 0.0
            out.append((step + 1, float(load.max() / load.double().mean()), load.tolist(), dropped, loss.item()))
            load.zero_()
        opt.step()
        opt.zero_grad()
    return out


def part_c(mesh: Mesh, ep) -> None:
    steps, every = 60, 10
    runs = [train_layer(mesh, ep, coef, steps, every) for coef in (0.0, 0.3)]
    say(f"\n(c) load balance: the layer trained {steps} steps (Adam, lr 0.01) to imitate a random map, 128 "
        f"tokens a step over the ranks,\n  from a router that favours experts 0 and 1. imb: the busiest expert's "
        f"assignments / the mean (1.00: balanced,\n  {E / K:.2f}: all on {K} experts) over the steps since the "
        f"last line; load: each expert's share of them, %;\n  drop: the share of rank 0's last batch that a "
        f"capacity factor of 1.25 would drop; loss: the task's")
    say(f"  {'step':>4}  {'aux_loss_coef 0: imb  load':<50}{'aux_loss_coef 0.3: imb  load'}")
    for a, b in zip(*runs):
        say(f"  {a[0]:>4}  " + "   ".join(f"{r[1]:4.2f}  {' '.join(f'{100 * c / sum(r[2]):>2.0f}' for c in r[2])}"
                                        f"  drop {r[3]:3.0%} loss {r[4]:.3f}" for r in (a, b)))


def tiny_moe(mesh: Mesh, ep: int):
    """The tiny-moe model at dp = world and this ep, built and wrapped as train.py does, and this rank's batch."""
    world = mesh.groups().dp.size
    cfg = TrainConfig(model="tiny-moe", dp=world, ep=ep, seq_len=SEQ, global_batch=2 * world, micro_batch=1,
                      dtype="float64")
    model, _ = build_model(cfg, mesh, get_config("tiny-moe"), torch.device("cpu"), torch.float64)
    x = torch.randint(0, 256, (2 * world, SEQ + 1), generator=torch.Generator().manual_seed(5))
    x = x[2 * mesh.groups().dp.rank:2 * mesh.groups().dp.rank + 2]
    wrapper = build_grad_sync(model, mesh.groups(), param_groups(model, cfg), partial(adamw, lr=cfg.lr))
    return model, wrapper, list(zip(x[:, :-1].split(1), x[:, 1:].split(1)))


def one_step(mesh: Mesh, ep: int) -> dict:
    """Expert bytes held; the ledger's bytes sent in one step, per group/op; assignments per expert."""
    model, wrapper, batch = tiny_moe(mesh, ep)
    held = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    mesh.ledger.reset()
    train_step(wrapper, batch, grad_clip=1.0)
    sent = {k: v["sent"] for k, v in mesh.ledger.snapshot().items()}
    return {"held": held, "sent": sent, "load": torch.tensor(take_load(model))}  # load: [layers, E], this rank's


def part_d(rep: Mesh, epm: Mesh) -> None:
    world, cfg = rep.groups().dp.size, get_config("tiny-moe")
    e, d, f, layers, n = cfg.n_experts, cfg.dim, cfg.expert_ffn_dim, cfg.n_layers, cfg.n_experts // world
    a, b = one_step(rep, 1), one_step(epm, world)
    mine, everyone = slice(epm.group("ep").rank * n, (epm.group("ep").rank + 1) * n), b["load"].clone()
    dist.all_reduce(everyone)  # every rank's assignments per expert (bookkeeping, not in the ledger)
    rows_out, rows_in = int(b["load"].sum() - b["load"][:, mine].sum()), int((everyone - b["load"])[:, mine].sum())
    experts = layers * e * 3 * d * f * 8
    say(f"\n(d) the tiny-moe model ({layers} MoE layers of {e} experts, d {d}, ffn {f}), float64, dp = {world}, "
        f"per rank 2 micro-batches of {SEQ} tokens; one step each way.\n  Expert weights of the whole model: "
        f"{layers} x {e} x 3 x {d} x {f} x 8 B = {experts:,} B")
    each_rank("  expert bytes held per rank: replicated (ep 1) | cut over ep (formula: / ep)",
              f"{a['held']:>8,} | {b['held']:>8,} = {experts:,} / {world}: {b['held'] == experts // world}")
    each_rank("  bytes sent in the step, from the ledger: replicated | cut over ep",
              " | ".join(", ".join(f"{k} {v:,}" for k, v in side["sent"].items()) for side in (a, b)))
    saved, ring = a["sent"]["dp/all_reduce"] - b["sent"]["dp/all_reduce"], 2 * (world - 1) * experts // world
    a2a, formula = b["sent"]["ep/all_to_all"], layers * 2 * (world - 1) * n * 8 + 2 * (rows_out + rows_in) * d * 8
    each_rank("  experts' share of the dp all-reduce (replicated - cut) vs 2 (N-1)/N x expert bytes; "
              "all-to-all vs counts + 2 (rows out + rows in) x d x 8",
              f"{saved:,} = {ring:,}: {saved == ring}   {a2a:,} = {formula:,}: {a2a == formula}   "
              f"(rows out {rows_out}, in {rows_in})")
    big, tokens = get_config("mixtral-8x7b"), 4096
    layer = big.n_experts * 3 * big.dim * big.expert_ffn_dim * 2  # bf16
    say(f"  for scale, one Mixtral-8x7B layer in bf16 at dp = ep = 8, {tokens} tokens per rank per micro-batch: "
        f"experts {layer / 2**30:.2f} GiB, {layer / 8 / 2**30:.2f} GiB per rank under ep;\n  replicated, their "
        f"gradient all-reduce sends 2 x 7/8 x that = {2 * 7 / 8 * layer / 2**30:.2f} GiB per step; the all-to-all "
        f"about 4 x {tokens} x {big.top_k} x 7/8 x {big.dim} x 2 B = {7 * tokens * big.top_k * big.dim / 2**20:.0f}"
        f" MiB per micro-batch")


def part_e(epm: Mesh) -> None:
    model, wrapper, batch = tiny_moe(epm, epm.group("ep").size)
    trace = epm.ledger.trace = [("mark", "target count")]  # train_step's first collective
    micro = iter(range(1, len(batch) + 1))
    model.register_forward_pre_hook(lambda *_: trace.append(("mark", f"micro-batch {next(micro)}")))
    for i, block in model.layers.items():
        block.moe.register_forward_pre_hook(lambda *_, i=i: trace.append(("mark", f"  layer {i} MoE forward")))
        block.moe.register_full_backward_pre_hook(lambda *_, i=i: trace.append(("mark", f"  layer {i} MoE backward")))
    for name in ("finish_grad_sync", "clip_and_step"):
        setattr(wrapper, name, marked(getattr(wrapper, name), name, trace))
    train_step(wrapper, batch, grad_clip=1.0)
    epm.ledger.trace = None
    traces = to_rank0([t for t in trace if t[0] != "mark"])
    say("\n(e) the collectives one training step posts, in posting order, on rank 0 (communicator, op, "
        "payload bytes).\n  Forward: the counts, the tokens out, the results back; backward: the results' "
        "gradients out, the tokens' back.\n  At ep = dp = world both groups are the world communicator.")
    if traces is None:
        return
    rows = []
    for t in trace:
        if t[0] == "mark":
            rows.append([t[1]])
        elif len(rows[-1]) > 1 and rows[-1][-1][:2] == (t[0][0], t[1]):
            rows[-1][-1][2].append(t[3])
        else:
            rows[-1].append((t[0][0], t[1], [t[3]]))
    for label, *ops in rows:
        text = "; ".join(f"{c} {op} x{len(b)}: " + ", ".join(f"{n:,}" for n in b) + " B" for c, op, b in ops)
        print(f"  {label:<24}{text or ('(nothing left: the bucket went during backward)' * ('sync' in label))}"
              .rstrip())
    print(f"  NCCL's ordering rules, on every rank's trace (order_check.order_problems): "
          f"{order_problems(traces) or 'kept'}")


def marked(fn, name: str, trace: list):
    def run(*args, **kwargs):
        trace.append(("mark", name))
        return fn(*args, **kwargs)
    return run


def table() -> None:
    """--table: the chapter's table of MoE sizes, from ModelConfig.num_params (no processes)."""
    print("| model | experts | total params | active per token |\n| --- | --- | --- | --- |")
    for name in ("small-moe", "mixtral-8x7b", "deepseek-moe-16b"):
        c = get_config(name)
        shape = f" ({c.n_layers} layers, d {c.dim})" if name == "small-moe" else ""  # a toy: its shape
        experts = (f"{c.n_experts} of {c.expert_ffn_dim}, top-{c.top_k}"
                   + (f", {c.n_shared_experts} shared" if c.n_shared_experts else "")
                   + (", first layer dense" if c.dense_layers == 1 else ""))
        unit, scale, digits = ("M", 1e6, 2) if c.num_params() < 1e9 else ("B", 1e9, 1)
        total, active = (f"{c.num_params(active=a) / scale:.{digits}f} {unit}" for a in (False, True))
        print(f"| `{name}`{shape} | {experts} | {total} | {active} |")


def main() -> None:
    import sys

    if sys.argv[1:] == ["--table"]:
        return table()
    start_gloo()
    world = dist.get_world_size()
    epm = Mesh.build(dp=world)
    epm.unflatten(("dp",), edp=1, ep=world)  # the dp ranks reshaped: edp 1 x ep world
    ep = epm.group("ep")
    part_b(epm, ep, part_a(ep))
    part_c(epm, ep)
    rep = Mesh.build(dp=world)  # another mesh, no ep: experts replicated
    part_d(rep, epm)
    part_e(epm)
    rep.destroy()
    finish(epm)


if __name__ == "__main__":
    main()
    leave()
