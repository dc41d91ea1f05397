"""Step 3: ZeRO, seen from every rank: what each one holds, what it sends, and that it changes nothing.

    .venv/bin/torchrun --standalone --nproc-per-node 4 scripts/course/step_03_zero.py    (2 works too)

All ranks form one dp group. The small Llama (seed 0) trains on a fixed global batch of 8 rows of
128 tokens, each rank its 8/N rows, at ZeRO stage 0 (plain DataParallel and AdamW), 1, 2 and 3:

(a) what each rank holds, measured on its tensors: parameters (weights present + master slices),
    gradients (right after backward, and their peak during it), AdamW state; next to the ZeRO
    paper's formulas (mixed precision, 2 + 2 + 12 bytes per parameter) and to what minipar holds
    here in float32. Stage 3 adds the largest amount of whole weights present while a layer runs;
(b) the bytes each rank sends in one step, from the mesh's ledger, next to 2 Psi (N-1)/N for
    stages 0-2 and 3 Psi (N-1)/N for stage 3 (Psi padded to a multiple of N in every bucket);
(c) activation memory: every tensor autograd saves for backward during one forward, counted with
    saved_tensors_hooks, per unit, without and with activation checkpointing (recompute); and
    where CPU offload puts ZeRO's slices (the gradient slices exist only from the reduce-scatter
    to the optimizer step, so they are looked at in between);
(d) in float64, three AdamW steps with 2 micro-batches per rank at each stage: the largest
    parameter difference from stage 0 (they are one optimizer), and the bytes of each step.

Chapter: docs/03_zero.md.
"""

from functools import partial

import torch
import torch.distributed as dist
from course_common import each_rank, finish, leave, say, start_gloo

from minipar.data_parallel import param_groups
from minipar.mesh import Mesh
from minipar.model import Llama, get_config
from minipar.parallelize import adamw, build_grad_sync, parallelize
from minipar.run.config import TrainConfig
from minipar.run.train import train_step
from minipar.zero import ZeroDataParallel
from minipar.zero3 import units_of

CFG = get_config("small")
OPT = TrainConfig()  # lr 3e-3, weight decay 0.1 on matrices, as scripts/train.py
ROWS, SEQ, CLIP, BUCKET_MB = 8, 128, 1.0, 0.5
STAGES = (0, 1, 2, 3)
NAMES = {0: "plain data parallelism", 1: "optimizer state sharded", 2: "gradients sharded too",
         3: "parameters sharded too"}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def global_batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return x, torch.roll(x, -1, dims=1)  # [B, s]: targets are the next token


def my_rows(mesh: Mesh, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    per = ROWS // mesh.groups().dp.size
    x, y = global_batch(step)
    r = mesh.groups().dp.rank
    return x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]  # [B/N, s]


def wrap(model: Llama, mesh: Mesh, stage: int, offload: bool = False):
    """The model behind stage `stage`'s wrapper; each wrapper owns its AdamW (`wrapper.optimizer`).
    ZeRO-3's buckets: one per unit (embedding, each layer, norm, head) and kind of parameter."""
    return build_grad_sync(model, mesh.groups(), param_groups(model, OPT), partial(adamw, lr=OPT.lr), zero=stage,
                           bucket_mb=BUCKET_MB, offload=offload)


def grad_bytes(wrapper) -> int:
    """Gradients held now: full .grad tensors (and, for ZeRO, this rank's gradient slices: they
    exist from a bucket's first reduce-scatter of the step until the optimizer step frees them)."""
    if isinstance(wrapper, ZeroDataParallel):
        return wrapper.gradient_bytes()
    return nbytes(p.grad for p in wrapper.module.parameters() if p.grad is not None)


def whole_weights(wrapper, units: dict[str, set[int]]) -> tuple[int, list[str]]:
    """Stage 3: bytes of the flat buffers gathered right now (each counted once), and whose they are."""
    present = [b for b in wrapper.buckets if b.full.untyped_storage().nbytes()]
    names = [name for name, ids in units.items() if any(id(b.params[0]) in ids for b in present)]
    return sum(b.full.untyped_storage().nbytes() for b in present), names


def state_bytes(optimizer) -> int:
    return nbytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())


# (a) and (b) ------------------------------------------------------------------------------------


def step_with_a_look(wrapper, x, y) -> int:
    """train_step (minipar/run/train.py) for one micro-batch, spelled out so we can count the
    gradients between backward and the step. Returns that count."""
    wrapper(x, y).backward()
    grads = grad_bytes(wrapper)
    wrapper.finish_grad_sync()  # stage 0: wait for the all-reduces; ZeRO: reduce-scatter what is left
    wrapper.clip_and_step(CLIP)  # stage 0: clip, AdamW; ZeRO: the same on the slices, then all-gather (1-2)
    return grads


def measure_stage(mesh: Mesh, stage: int) -> dict:
    model = Llama(CFG, seed=0)  # float32
    units = {name: {id(p) for p in m.parameters()} for name, m in model.named_modules()
             if any(m is u for u in units_of(model))}
    peak = {"grads": 0, "weights": 0, "units": []}
    holder = []

    def look(*_):
        peak["grads"] = max(peak["grads"], grad_bytes(holder[0]))
        if stage == 3:
            now, names = whole_weights(holder[0], units)
            if now > peak["weights"]:
                peak.update(weights=now, units=names)

    for p in model.parameters():  # before the wrapper's own hooks: sees a bucket before it is freed
        p.register_post_accumulate_grad_hook(look)
    wrapper = wrap(model, mesh, stage)
    holder.append(wrapper)
    if stage == 3:  # after stage 3's own pre-hook has gathered this unit and started the next
        for unit in units_of(model):
            unit.register_forward_pre_hook(look)
    x, y = my_rows(mesh)
    mesh.ledger.reset()
    grads = step_with_a_look(wrapper, x, y)
    ledger = mesh.ledger.snapshot()
    if stage == 0:
        params = nbytes(model.parameters())
        buffers = nbytes(b.buffer for b in wrapper.buckets)
        padded, n_buckets, sizes = CFG.num_params(), len(wrapper.buckets), []
    else:
        params, buffers = wrapper.param_bytes(), 0
        padded, n_buckets = sum(b.padded for b in wrapper.buckets), len(wrapper.buckets)
        sizes = [sum(p.numel() for p in b.params) for b in wrapper.buckets]
    return dict(params=params, grads=grads, grads_peak=peak["grads"], optim=state_bytes(wrapper.optimizer),
                weights_peak=peak["weights"], weights_units=peak["units"], ledger=ledger, padded=padded,
                buckets=n_buckets, sizes=sizes, dp_buffers=buffers)


def paper_bytes(stage: int, psi: int, n: int) -> tuple[int, int, int]:
    """The ZeRO paper's per-rank model states: 2 Psi fp16 weights, 2 Psi fp16 gradients, K = 12
    bytes of optimizer state (fp32 master weights, momentum, variance), each /N once sharded."""
    def per_rank(size: int, sharded_from: int) -> int:
        return size // n if stage >= sharded_from else size
    return per_rank(2 * psi, 3), per_rank(2 * psi, 2), per_rank(12 * psi, 1)


def minipar_bytes(stage: int, psi: int, padded: int, n: int) -> tuple[int, int, int]:
    """What minipar holds in float32 at the moment backward ends. Stages 1-2 keep every weight
    (views of the buckets' padded flat vectors) *and* a float32 master slice of it. Stage 1 holds
    the full .grad tensors: it reduce-scatters only after backward, so no gradient slice exists
    yet. Stages 2-3 have reduce-scattered every bucket during backward: only the slices are left.
    Adam's two moments are the whole optimizer state (the master copy is counted with the
    parameters)."""
    mine = 4 * padded // n  # one float32 slice of every bucket
    if stage == 0:
        return 4 * psi, 4 * psi, 8 * psi
    weights = 0 if stage == 3 else 4 * padded
    grads = 4 * psi if stage == 1 else mine
    return weights + mine, grads, 2 * mine


def part_a_b(mesh: Mesh) -> None:
    n, psi = mesh.groups().dp.size, CFG.num_params()
    say(f"small Llama, float32: Psi = {psi:,} parameters; dp = N = {n}; global batch {ROWS} x {SEQ} tokens, "
        f"{ROWS // n} rows per rank; stage 0-2 buckets of {BUCKET_MB} MiB")
    results = {stage: measure_stage(mesh, stage) for stage in STAGES}

    say("\n(a) what each rank holds, bytes. 'grads' right after backward; 'peak' the most during it")
    head = f"  {'':<27}{'params':>12}{'grads':>12}{'peak':>12}{'optimizer':>12}{'total':>13}"
    for stage, r in results.items():
        say(f"\nstage {stage}: {NAMES[stage]}"
            + (f"   (padded Psi' = {r['padded']:,} in {r['buckets']} buckets)" if stage else ""))
        say(head)
        p, g, o = paper_bytes(stage, psi, n)
        say(f"  {'paper, 2+2+12 bytes/param':<27}{p:>12,}{g:>12,}{'':>12}{o:>12,}{p + g + o:>13,}")
        p, g, o = minipar_bytes(stage, psi, r["padded"], n)
        say(f"  {'minipar fp32, formula':<27}{p:>12,}{g:>12,}{'':>12}{o:>12,}{p + g + o:>13,}")
        each_rank("", f"{'measured':<19}{r['params']:>12,}{r['grads']:>12,}{r['grads_peak']:>12,}{r['optim']:>12,}"
                      f"{r['params'] + r['grads'] + r['optim']:>13,}")
        if stage == 0:
            each_rank("  besides: DataParallel's flat all-reduce buffers, one per bucket, kept between steps",
                      f"{r['dp_buffers']:,} bytes")
        if stage == 3:
            ends = CFG.vocab_size * CFG.dim * (1 if CFG.tie_embeddings else 2)  # the embedding and the head
            each_rank("  besides: whole weights present at once (looked at as units start, gradients arrive), at most;"
                      f" the embedding and the head are {ends / psi:.0%} of Psi",
                      f"{r['weights_peak']:,} bytes ({' + '.join(r['weights_units'])}), "
                      f"{r['weights_peak'] / (4 * psi):.0%} of all weights")

    say("\n(b) bytes sent by each rank in one step (mesh ledger), float32 = 4 bytes per element")
    say(f"  {'stage':<7}{'group/op':<22}{'calls':>6}{'payload B':>14}{'sent B':>14}{'sent elements':>15}")
    for stage, r in results.items():
        for key, e in r["ledger"].items():
            say(f"  {stage:<7}{key:<22}{e['calls']:>6}{e['bytes']:>14,}{e['sent']:>14,}{e['sent'] // 4:>15,}")
        k, size = (3, r["padded"]) if stage == 3 else (2, r["padded"])
        formula = k * (n - 1) * size // n
        label = f"formula {k} {'Psi' if stage == 0 else 'Psi' + chr(39)} (N-1)/N"
        say(f"  {'':<7}{label:<42}{formula * 4:>14,}{formula:>15,}")
    pads = ", ".join(f"stage {s}: {r['padded'] - psi}" for s, r in results.items() if s)
    say(f"  padding (elements added so that every bucket splits in N equal slices): {pads}")
    three = ", ".join(f"stage {s}: {sum(-size % 3 for size in r['sizes'])}" for s, r in results.items() if s)
    say(f"  (every bucket here holds a multiple of 128 elements; the same buckets at N = 3 would pad {three})")
    each_rank("  total sent per step",
              "   ".join(f"stage {s} {sum(e['sent'] for e in r['ledger'].values()):,}" for s, r in results.items()))


# (c) --------------------------------------------------------------------------------------------


def saved_for_backward(model: Llama, wrapper, x, y):
    """One forward with a hook on every tensor autograd saves for backward. Returns the loss and
    {unit: bytes}: each storage counted once, the weights not at all (they are held anyway).
    With recompute, a checkpointed layer saves nothing inside; checkpoint saves its inputs."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    unit = ["embedding"]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in seen:
            seen[ptr] = (unit[0], t.untyped_storage().nbytes())
        return t

    # When a unit finishes, what is saved next belongs to the next one (checkpoint saves a layer's
    # inputs before the layer itself starts).
    names = [f"layer {i}" for i in model.layers] + ["head + loss"]
    finished = [model.tok_emb, *model.layers.values()]
    handles = [m.register_forward_hook(lambda *a, name=name: unit.__setitem__(0, name))
               for m, name in zip(finished, names)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = wrapper(x, y)
    for h in handles:
        h.remove()
    by_unit: dict[str, int] = {}
    for label, size in seen.values():
        by_unit[label] = by_unit.get(label, 0) + size
    return loss, by_unit


def part_c(mesh: Mesh) -> None:
    n = mesh.groups().dp.size
    x, y = my_rows(mesh)
    say(f"\n(c) activations: bytes autograd saves for backward in one forward, {ROWS // n} x {SEQ} tokens per rank, "
        f"float32; ZeRO stage 2")
    runs, grads, places, params = {}, {}, {}, {}
    for recompute, offload in ((False, False), (True, False), (False, True), (True, True)):
        model = parallelize(Llama(CFG, seed=0), recompute=recompute)
        wrapper = wrap(model, mesh, 2, offload=offload)
        loss, by_unit = saved_for_backward(model, wrapper, x, y)
        loss.backward()  # with recompute, each layer runs its forward again here
        wrapper.finish_grad_sync()  # nothing left to do: stage 2 reduce-scattered during backward
        # The gradient slices exist from the reduce-scatter until the step: look at them now.
        first = wrapper.buckets[0]
        grads[recompute, offload] = torch.cat([b.grad_slice for b in wrapper.buckets])
        grad_device = first.grad_slice.device
        slices = nbytes(t for b in wrapper.buckets for t in (b.master, b.grad_slice))
        wrapper.clip_and_step(CLIP)
        freed = all(b.grad_slice is None for b in wrapper.buckets)
        runs[recompute, offload] = by_unit
        params[recompute, offload] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        state = wrapper.optimizer.state[first.master]
        places[offload] = (f"weights on {model.lm_head.weight.device}, master slices on {first.master.device}, "
                           f"their gradients on {grad_device} ({'freed' if freed else 'kept'} by the step), "
                           f"Adam moments on {state['exp_avg'].device}")
        offloaded = slices + state_bytes(wrapper.optimizer)

    plain, checkpointed = runs[False, False], runs[True, False]
    say(f"  {'unit':<22}{'without recompute':>20}{'with recompute':>18}")
    for label in plain:
        say(f"  {label:<22}{plain[label]:>20,}{checkpointed.get(label, 0):>18,}")
    total, kept = sum(plain.values()), sum(checkpointed.values())
    one_layer = max(v for k, v in plain.items() if k.startswith("layer"))
    say(f"  {'total after forward':<22}{total:>20,}{kept:>18,}")
    say(f"  with recompute, a layer's backward first rebuilds its activations (up to {one_layer:,} bytes): "
        f"at most {kept + one_layer:,} saved at once")
    each_rank("  per rank: after forward without / with recompute; recompute changes the gradient by",
              f"{total:,} / {kept:,} bytes; "
              f"{(grads[False, False] - grads[True, False]).abs().max().item():.1e}")
    each_rank("\n  where the tensors live, offload=False", places[False])
    each_rank("  offload=True (on a machine without a GPU the model's device is the CPU already)", places[True])
    each_rank("  bytes offload puts in host memory during a step (master + gradient slices + Adam); "
              "same parameters after a step?",
              f"{offloaded:,} bytes; {torch.equal(params[False, False], params[False, True])}")


# (d) --------------------------------------------------------------------------------------------


def one_device() -> dict[str, torch.Tensor]:
    """The plain computation: the same 3 steps on one device, the whole batch at once."""
    model = Llama(CFG, seed=0).double()
    optimizer = adamw(param_groups(model, OPT), OPT.lr)
    for step in range(3):
        model(*global_batch(step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def largest_difference(a: dict, b: dict) -> str:
    name = max(a, key=lambda n: (a[n] - b[n]).abs().max().item())
    worst = (a[name] - b[name]).abs().max().item()
    return f"{worst:.1e} ({name})"  # 0.0e+00 when bit-identical (docs-check reads any |x| < 1e-12 as equal)


def part_d(mesh: Mesh) -> None:
    say("\n(d) float64, 3 AdamW steps (clip 1.0) through train_step, 2 micro-batches per rank")
    final, sent = {}, {}
    for stage in STAGES:
        model = Llama(CFG, seed=0).double()
        wrapper = wrap(model, mesh, stage)
        sent[stage] = []
        for step in range(3):
            x, y = my_rows(mesh, step)
            mesh.ledger.reset()
            train_step(wrapper, list(zip(x.chunk(2), y.chunk(2))), grad_clip=CLIP)
            sent[stage].append(sum(e["sent"] for e in mesh.ledger.snapshot().values()))
        with wrapper.gathered():  # stage 3: the weights are sharded; the others hold them whole
            final[stage] = {n: p.detach().clone() for n, p in model.named_parameters()}
    each_rank("  max |stage s - stage 0| over all parameters, and where",
              "  ".join(f"stage {s}: {largest_difference(final[s], final[0])}" for s in (1, 2, 3)))
    if dist.get_rank() == 0:
        reference = one_device()
        print(f"  for scale, max |stage 0 - one device on the whole batch|: {largest_difference(final[0], reference)}")
    n, psi = mesh.groups().dp.size, CFG.num_params()
    say(f"  bytes sent per step with 2 micro-batches (float64; one Psi (N-1)/N = {(n - 1) * psi * 8 // n:,} bytes):")
    for stage in STAGES:
        ratio = sent[stage][0] / ((n - 1) * psi * 8 / n)
        say(f"    stage {stage}: {sent[stage][0]:>12,}  = {ratio:.3f} x Psi (N-1)/N")


def main() -> None:
    start_gloo()
    mesh = Mesh.build(dp=dist.get_world_size())
    if ROWS % (2 * mesh.groups().dp.size):
        raise SystemExit(f"{ROWS} rows do not split into {mesh.groups().dp.size} ranks x 2 micro-batches")
    part_a_b(mesh)
    part_c(mesh)
    part_d(mesh)
    finish(mesh)


if __name__ == "__main__":
    main()
    leave()
