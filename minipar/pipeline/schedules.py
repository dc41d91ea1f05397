"""Pipeline schedules as data: for each rank, the ordered list of what it computes (chapter 6).

Cut the layers into p stages and the batch into m micro-batches; a schedule orders each rank's actions:
F(i) forward of micro-batch i, B(i) its backward (input gradient; with no W, both), W(i) its weight
gradient. Nothing here runs a model: a schedule is printed, drawn, simulated (timeline.py) and tested
without a process; executor.py runs any. The six: naive, gpipe, 1f1b, interleaved (v chunks a rank),
zb1 (ZB-H1: W's fill the bubble), zbv (ZB-V: rank r holds stages r and 2p-1-r). `build(name, p, m, v)`
gives every rank's actions and `placement[k]`, the rank of stage k; `messages_of` says what an action
receives and sends: the executor posts those, the estimator counts them, the order check traces them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    microbatch: int
    stage: int  # virtual stage (equals the rank unless interleaved)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


class ScheduleError(ValueError):
    """A schedule that cannot be built for these sizes; the message says what to change."""


@dataclass(frozen=True)
class Schedule:
    actions: list[list[Action]]  # actions[r]: what rank r runs, in order
    placement: tuple[int, ...]  # placement[k]: the rank that holds stage k

    @property
    def n_stages(self) -> int:
        return len(self.placement)


def inputs_of(a: Action, n_stages: int) -> list[Action]:
    """The actions whose results `a` needs: the one dependency rule of every builder and the
    simulator. F needs the previous stage's F; B needs its own F and the next stage's B; W its B."""
    i, k = a.microbatch, a.stage
    if a.kind == "F":
        return [Action("F", i, k - 1)] if k > 0 else []
    if a.kind == "B":
        return [Action("F", i, k)] + ([Action("B", i, k + 1)] if k < n_stages - 1 else [])
    return [Action("B", i, k)]


# The schedules
def naive(p: int, m: int) -> list[list[Action]]:
    """Model parallelism with no pipelining: the whole batch as one micro-batch."""
    if m != 1:
        raise ScheduleError(f"the naive schedule runs one micro-batch, got {m}: use gpipe or 1f1b for more")
    return gpipe(p, 1)


def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe: every rank runs all m forwards, then all m backwards, in micro-batch order.

    p = 2, m = 3: both ranks get the same list, and the dependencies stagger them in time
    (timeline.simulate, F = 1, B = 2):

        actions[0] = actions[1] = [F0 F1 F2 B0 B1 B2]
        rank 0:  F0 F1 F2  .  .  . B0 B0 B1 B1 B2 B2
        rank 1:   . F0 F1 F2 B0 B0 B1 B1 B2 B2  .  .
    """
    return [[Action("F", i, s) for i in range(m)] + [Action("B", i, s) for i in range(m)] for s in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """1F1B: stage s runs p-s-1 warm-up forwards, then one forward and its oldest backward in turn,
    then the backwards left. At most p-s micro-batches are between their F and their B.

    p = 3, m = 4 (warm-ups 2, 1, 0):

        rank 0:  F0 F1 | F2 B0  F3 B1 | B2 B3          warm-up | steady (F, then B) | drain
        rank 1:  F0    | F1 B0  F2 B1  F3 B2 | B3
        rank 2:        | F0 B0  F1 B1  F2 B2  F3 B3
    """
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [Action("F", i, s) for i in range(warmup)]
        for i in range(warmup, m):  # steady state: one forward, then the oldest backward
            acts += [Action("F", i, s), Action("B", i - warmup, s)]
        acts += [Action("B", i, s) for i in range(m - warmup, m)]
        out.append(acts)
    return out


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: v chunks per rank, micro-batches in groups of p.

    Rank s holds the virtual stages s, s+p, ..., s+(v-1)p (chunk c is stage c*p + s). Its k-th
    forward is worked out by `action`: k counts through groups of p*v forwards; inside a group, the
    first p run chunk 0 on micro-batches group*p .. group*p+p-1, the next p chunk 1 on the same
    micro-batches, and so on. Backwards walk the same order with the chunks reversed (the last
    chunk's backward comes first). Rank s warms up with 2(p-s-1) + (v-1)p forwards, then
    alternates one forward and one backward.

    p = 2, v = 2, m = 4 (stages 0 and 2 on rank 0, 1 and 3 on rank 1), written F<micro-batch>/<stage>:

        k           0    1    2    3    4    5    6    7
        forward   F0/0 F1/0 F0/2 F1/2 F2/0 F3/0 F2/2 F3/2     (rank 0; action("F", k, 0))
        backward  B0/2 B1/2 B0/0 B1/0 B2/2 B3/2 B2/0 B3/0     (rank 0; action("B", k, 0))

        rank 0 (warm-up 2*1 + 1*2 = 4):  F0/0 F1/0 F0/2 F1/2 | F2/0 B0/2 F3/0 B1/2 F2/2 B0/0 ...
        rank 1 (warm-up 0 + 1*2 = 2):    F0/1 F1/1 | F0/3 B0/3 F1/3 B1/3 F2/1 B0/1 ...
    """
    if v < 2:
        raise ScheduleError("the interleaved schedule needs --virtual-stages of at least 2")
    if m % p:
        raise ScheduleError(f"the interleaved schedule needs micro-batches ({m}) divisible by pp ({p})")
    total = m * v

    def action(kind: str, k: int, s: int) -> Action:  # rank s's k-th forward (or backward)
        group, within = divmod(k, p * v)
        chunk = within // p if kind == "F" else v - 1 - within // p
        return Action(kind, group * p + within % p, chunk * p + s)

    out = []
    for s in range(p):
        warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
        acts = [action("F", f, s) for f in range(warmup)]
        for b in range(total):  # then the next forward (while any are left) and the next backward
            if warmup + b < total:
                acts.append(action("F", warmup + b, s))
            acts.append(action("B", b, s))
        out.append(acts)
    return out


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's order of F and B, with each W placed where its stage would otherwise wait
    (`_fill_with_w`). W frees the activations, and a rank holds at most p micro-batches between F
    and W: 1F1B's peak (its first stage), now on every stage. With F = B = W the idle fraction is
    (p-1) / (3m + p-1): the paper's bubble rate (p-1)/(3m), as a share of the whole step."""
    def next_in_plan(r, todo, ready, held):  # 1F1B's order; a new F waits while p are held
        nxt = todo[0] if todo else None
        return nxt if nxt in ready and not (nxt.kind == "F" and held >= p) else None

    return _fill_with_w(one_f_one_b(p, m), p, next_in_plan)


def _fill_with_w(todo: list[list[Action]], n_stages: int, choose) -> list[list[Action]]:
    """The zero-bubble construction, in unit time: at each step every rank runs the F or B that
    `choose(rank, its remaining actions, those whose inputs are done, activations held)` picks,
    else the W of its oldest finished B (nobody waits for a W), else idles. A B queues its W."""
    p = len(todo)
    done: dict[Action, int] = {}
    out: list[list[Action]] = [[] for _ in range(p)]
    pending_w: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(todo) or any(pending_w):
        for r in range(p):
            held = sum(a.kind == "F" for a in out[r]) - sum(a.kind == "W" for a in out[r])
            ready = [a for a in todo[r] if all(x in done and done[x] <= t for x in inputs_of(a, n_stages))]
            act = choose(r, todo[r], ready, held)
            if act is not None:
                todo[r].remove(act)
                if act.kind == "B":
                    pending_w[r].append(Action("W", act.microbatch, act.stage))
            elif pending_w[r]:
                act = pending_w[r].pop(0)
            else:
                continue
            out[r].append(act)
            done[act] = t + 1  # not ready for another rank until the next step
        t += 1
        if t > 20 * (sum(map(len, out)) + n_stages) + 100:
            raise ScheduleError("zero-bubble schedule construction did not finish")  # cannot happen; a guard
    return out


def zero_bubble_v(p: int, m: int) -> list[list[Action]]:
    """ZB-V: 2p stages in a V over p ranks, split backward, built by simulating unit-time actions.

    At each time step a rank runs, among the actions whose inputs are done: a B (the stages
    before it wait for its input gradient), else an F, else its oldest pending W; the lowest
    micro-batch first, so that each stage's neighbours send in the order it receives. An F on a
    rank's first chunk waits while it holds 2p chunk activations (1F1B's peak on its first stage);
    F's on the way back up never wait, or the loss could never be reached, so the peak can pass 2p
    (about 1.4x at m >= 2p): the paper's hand-made ZB-V keeps 1F1B's peak, this greedy one spends
    memory for fewer idle slots.

    p = 2, m = 2: rank 0 holds stages 0 and 3 (a, b), rank 1 stages 1 and 2; stage 1 hands its
    output to stage 2 on the same rank. F = B = W = 1 (timeline.simulate):

        rank 0:  F0a F1a   . F0b B0b F1b B1b B0a W0b B1a W1b W0a W1a
        rank 1:    . F0a F0b F1a F1b B0b B0a B1b B1a W0b W0a W1b W1a
    """
    n = 2 * p
    todo = [[Action(kind, i, k) for i in range(m) for k in (r, n - 1 - r) for kind in "FB"] for r in range(p)]

    def b_first_then_f(r, todo, ready, held):  # a new micro-batch on chunk a waits while 2p are held
        ready = [a for a in ready if not (a.kind == "F" and a.stage == r and held >= n)]
        return min(ready, key=lambda a: (a.kind != "B", a.microbatch, -a.stage), default=None)

    return _fill_with_w(todo, n, b_first_then_f)


def looped_placement(p: int, v: int = 1) -> tuple[int, ...]:
    """Stage k on rank k % p: with v chunks per rank, rank r holds r, r+p, r+2p, ..."""
    return tuple(k % p for k in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    """Stages 0..p-1 down the ranks, p..2p-1 back up: rank r holds r and 2p-1-r."""
    return tuple(range(p)) + tuple(reversed(range(p)))


# name -> (the stage placement for p ranks and v chunks, the action builder for p, m, v)
SCHEDULES = {
    "naive": (looped_placement, lambda p, m, v: naive(p, m)),
    "gpipe": (looped_placement, lambda p, m, v: gpipe(p, m)),
    "1f1b": (looped_placement, lambda p, m, v: one_f_one_b(p, m)),
    "interleaved": (looped_placement, interleaved),
    "zb1": (looped_placement, lambda p, m, v: zero_bubble_h1(p, m)),
    "zbv": (lambda p, v: v_placement(p), lambda p, m, v: zero_bubble_v(p, m)),
}


def placement(name: str, p: int, v: int = 1) -> tuple[int, ...]:
    """Which rank holds each stage under schedule `name` (it does not depend on m)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule '{name}': choose one of {', '.join(SCHEDULES)}")
    if name != "interleaved" and v != 1:
        raise ScheduleError("--virtual-stages above 1 needs --schedule interleaved")
    return SCHEDULES[name][0](p, v)


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Schedule `name` on p ranks and m micro-batches: every rank's actions and the placement."""
    stages = placement(name, p, v)
    if m < 1 or p < 1:
        raise ScheduleError("pp and the number of micro-batches must be at least 1")
    return Schedule(SCHEDULES[name][1](p, m, v), stages)


# What travels: the one statement of an action's messages, for the executor and the estimator
@dataclass(frozen=True)
class Message:
    """One tensor from stage `src` to its neighbour `dst`, for micro-batch `microbatch`: activations
    go forward on channel "pp", their gradients back on "pp_grad" (the executor's two process
    groups). Ranks are the placement's; when both are one rank (zbv's turn of the V) the tensor is
    handed over in memory, not sent. The sender's and the receiver's Message are equal."""

    channel: str  # "pp" or "pp_grad"
    microbatch: int
    src: int
    dst: int
    src_rank: int
    dst_rank: int

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank


def messages_of(a: Action, placement: tuple[int, ...]) -> tuple[Message | None, Message | None]:
    """(what `a` receives before it runs, what it sends once done), as the executor's docstring
    lists them; None past an end of the pipeline (stage 0 reads the tokens, the last stage computes
    the loss and starts backward from it), and for W, whose weight gradients stay on the rank."""
    i, k, n = a.microbatch, a.stage, len(placement)

    def message(channel: str, src: int, dst: int) -> Message | None:  # None past an end of the pipeline
        return Message(channel, i, src, dst, placement[src], placement[dst]) if 0 <= src < n and 0 <= dst < n else None

    if a.kind == "F":
        return message("pp", k - 1, k), message("pp", k, k + 1)
    if a.kind == "B":
        return message("pp_grad", k + 1, k), message("pp_grad", k, k - 1)
    return None, None


def messages_per_step(schedule: Schedule, rank: int, message_bytes: int) -> list[tuple[str, int]]:
    """What `rank`'s actions send in one step, as the executor posts them: (the ledger's "channel/send"
    key, `message_bytes`) for each outgoing message that leaves the rank."""
    outgoing = [messages_of(a, schedule.placement)[1] for a in schedule.actions[rank]]
    return [(f"{m.channel}/send", message_bytes) for m in outgoing if m is not None and not m.local]


# Memory and bubble, read off the actions (the clock itself is timeline.simulate)
def peak_activations(actions: list[Action]) -> int:
    """The most micro-batches whose activations a rank holds at once: from F until B releases
    them, or W when the schedule splits the backward."""
    split = any(a.kind == "W" for a in actions)
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == ("W" if split else "B"):
            held -= 1
    return peak


def bubble_formula(p: int, m: int) -> float:
    """GPipe's and 1F1B's idle fraction: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)
