"""Pipeline schedules, as data: no processes. Order, deadlock-freedom, bubbles and memory."""

import pytest

from minipar.order_check import order_problems
from minipar.pipeline.schedules import (
    Action,
    Schedule,
    ScheduleError,
    bubble_formula,
    build,
    messages_of,
    peak_activations,
)
from minipar.pipeline.timeline import simulate

SIZES = [(p, m) for p in range(1, 9) for m in (1, 2, 3, 4, 5, 8, 12, 16) ]


def cases():
    for p, m in SIZES:
        yield "gpipe", p, m, 1
        yield "1f1b", p, m, 1
        yield "zb1", p, m, 1
        if p > 1:
            yield "zbv", p, m, 1
        if m % p == 0 and p > 1:
            yield "interleaved", p, m, 2
            yield "interleaved", p, m, 3
    for p in range(1, 9):
        yield "naive", p, 1, 1


CASES = list(cases())


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_every_action_once_forward_before_backward_and_no_deadlock(name, p, m, v):
    schedule = build(name, p, m, v)
    sched = schedule.actions
    assert len(sched) == p
    split = name in ("zb1", "zbv")
    chunks = 2 if name == "zbv" else v
    for rank, acts in enumerate(sched):
        stages = {a.stage for a in acts}
        assert stages == {k for k, r in enumerate(schedule.placement) if r == rank}  # where each stage lives
        expected = {rank + k * p for k in range(v)} if name != "zbv" else {rank, 2 * p - 1 - rank}  # looped, or a V
        assert stages == expected
        kinds = "FBW" if split else "FB"
        assert sorted(map(str, acts)) == sorted(f"{k}{i}" for k in kinds for i in range(m) for _ in range(chunks))
        assert len(set(acts)) == len(acts)
        position = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a.kind != "F":
                assert position[Action("F", a.microbatch, a.stage)] < position[a]
            if a.kind == "W":
                assert position[Action("B", a.microbatch, a.stage)] < position[a]
    simulate(schedule)  # raises ScheduleError on deadlock


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32), (3, 7)])
def test_gpipe_and_1f1b_idle_fraction_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for name in ("gpipe", "1f1b"):
        assert simulate(build(name, p, m)).idle_fraction() == pytest.approx(bubble_formula(p, m), abs=1e-12)


@pytest.mark.parametrize("m", [1, 4, 8])
def test_a_heavier_last_stage_sets_the_pace_and_costs_replay_a_timeline(m):
    # Stage 1 costs twice stage 0 (the LM head and the loss): it runs m (F + B) = 6m back to back,
    # after stage 0's first F and before its last B, whatever the schedule: 6m + 3, not (m + 1) 3.
    costs = {"F": 1.0, "B": 2.0, ("F", 1): 2.0, ("B", 1): 4.0}
    for name in ("gpipe", "1f1b"):
        sim = simulate(build(name, 2, m), costs)
        assert sim.makespan == 6 * m + 3
        assert sim.idle_fraction() == pytest.approx(1 - 9 * m / (2 * (6 * m + 3)), abs=1e-12)
        assert sim.costs() == {(k, s): costs[k, s] if (k, s) in costs else costs[k] for k in "FB" for s in (0, 1)}
        assert simulate(build(name, 2, m), sim.costs()).rows == sim.rows  # a run's costs replay it exactly


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_bubble_is_about_one_vth_and_zb1_smaller_than_1f1b(p, m):
    one_f_one_b = simulate(build("1f1b", p, m)).idle_fraction()
    for v in (2, 4):
        inter = simulate(build("interleaved", p, m, v)).idle_fraction()
        # Megatron's figure: (p-1) / (v*m + p-1) - about 1/v of 1F1B's when m >> p.
        assert inter == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        assert inter < one_f_one_b
    zb1 = simulate(build("zb1", p, m)).idle_fraction()
    assert zb1 < one_f_one_b and zb1 == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)  # the paper's
    assert simulate(build("zbv", p, m)).idle_fraction() < zb1  # the V fills what ZB-H1 leaves


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16), (8, 32)])
def test_1f1b_holds_at_most_p_micro_batches_while_gpipe_holds_m(p, m):
    assert [peak_activations(acts) for acts in build("gpipe", p, m).actions] == [m] * p
    assert [peak_activations(acts) for acts in build("1f1b", p, m).actions] == [p - s for s in range(p)]
    assert [peak_activations(acts) for acts in build("zb1", p, m).actions] == [p] * p  # 1F1B's peak, every stage


def test_a_wrong_order_is_caught_as_deadlock():
    # Stage 1 wants the backward of micro-batch 1 before that of 0, but stage 0 runs B0 first,
    # whose input (B0 of stage 1) comes only after B1: each waits for the other.
    bad = [[Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0)],
           [Action("F", 0, 1), Action("F", 1, 1), Action("B", 1, 1), Action("B", 0, 1)]]
    simulate(Schedule(bad, (0, 1)))  # fine: stage 1's B1 does not need stage 0
    worse = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
             [Action("F", 1, 1), Action("B", 1, 1), Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Schedule(worse, (0, 1)))


def test_ascii_timeline_shows_the_bubble():
    text = simulate(build("gpipe", 2, 2)).ascii()
    assert text.splitlines() == [
        "rank 0:  F0 F1  .  .  . B0 B0 B1 B1",
        "rank 1:   . F0 F1 B0 B0 B1 B1  .  .",
    ]


@pytest.mark.parametrize("args,msg", [
    (("interleaved", 4, 6, 2), "divisible by pp"),
    (("interleaved", 4, 8, 1), "at least 2"),
    (("1f1b", 4, 8, 2), "needs --schedule interleaved"),
    (("naive", 4, 8, 1), "one micro-batch"),
    (("bogus", 4, 8, 1), "unknown schedule"),
])
def test_bad_schedule_requests_are_refused(args, msg):
    with pytest.raises(ScheduleError, match=msg):
        build(*args)


def test_timeline_draws_as_png(tmp_path):
    simulate(build("interleaved", 2, 4, 2)).draw(str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# NCCL matches point-to-point messages by posting order: for every schedule, pp and micro-batch
# count, the receives each rank posts from a neighbour come in the order that neighbour sends.
ORDER_CASES = [(name, p, m, v) for p in range(2, 9) for m in (p, 2 * p, 2 * p + 1)
               for name, v in (("gpipe", 1), ("1f1b", 1), ("zb1", 1), ("zbv", 1), ("interleaved", 2))
               if not (name == "interleaved" and m % p)] + [("naive", p, 1, 1) for p in range(2, 9)]


def traces_of(schedule: Schedule) -> list[list[tuple]]:
    """What each rank posts when it runs its actions, in order, as order_check reads a ledger's
    trace: (channel, "send" or "recv", peer rank, micro-batch). The micro-batch stands in for the
    message's size, so that a receive matched with the wrong message is caught even when the sizes
    agree. Two stages on one rank pass their tensors by hand: no message."""
    ranks = tuple(range(len(schedule.actions)))
    traces = []
    for acts in schedule.actions:
        trace = []
        for a in acts:
            incoming, outgoing = messages_of(a, schedule.placement)
            if incoming is not None and not incoming.local:
                trace.append(((incoming.channel, ranks), "recv", incoming.src_rank, incoming.microbatch))
            if outgoing is not None and not outgoing.local:
                trace.append(((outgoing.channel, ranks), "send", outgoing.dst_rank, outgoing.microbatch))
        traces.append(trace)
    return traces


@pytest.mark.parametrize("name,p,m,v", ORDER_CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in ORDER_CASES])
def test_every_schedule_receives_in_the_order_its_neighbour_sends(name, p, m, v):
    schedule = build(name, p, m, v)
    traces = traces_of(schedule)
    assert order_problems(traces) == []
    # Every stage boundary between two ranks carries m activations and m gradients (zbv's turn
    # of the V, two stages on one rank, carries none).
    crossings = sum(schedule.placement[k] != schedule.placement[k + 1] for k in range(schedule.n_stages - 1))
    assert sum(op == "send" for trace in traces for _, op, _, _ in trace) == 2 * m * crossings
    # Each message is received once, as the same Message its sender names (the executor keys the
    # hand-overs of zbv's turn by it).
    both_ends = [messages_of(a, schedule.placement) for acts in schedule.actions for a in acts]
    assert sorted(map(repr, filter(None, (out for _, out in both_ends)))) == \
        sorted(map(repr, filter(None, (inc for inc, _ in both_ends))))


def test_a_receive_out_of_order_is_caught():
    traces = traces_of(build("1f1b", 2, 2))
    traces[1][0], traces[1][2] = traces[1][2], traces[1][0]  # rank 1 asks for micro-batch 1 first
    assert order_problems(traces)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_zbv_places_stages_in_a_v_and_its_peak_is_bounded(p, m):
    schedule = build("zbv", p, m)
    assert schedule.placement == tuple(range(p)) + tuple(reversed(range(p)))  # rank 0: first and last stage
    peaks = [peak_activations(acts) for acts in schedule.actions]  # in chunks, half a rank's layers each
    assert max(peaks) <= 3 * p  # 1.5x 1F1B's 2p chunks at most (see zero_bubble_v)


def test_the_worked_examples_in_the_builders_docstrings_are_what_they_build():
    def named(acts, stage=False):
        return " ".join(f"{a}/{a.stage}" if stage else str(a) for a in acts)

    assert [named(acts) for acts in build("gpipe", 2, 3).actions] == ["F0 F1 F2 B0 B1 B2"] * 2
    assert [named(acts) for acts in build("1f1b", 3, 4).actions] == [
        "F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"]
    rank0, rank1 = build("interleaved", 2, 4, 2).actions
    assert named(rank0[:10], stage=True) == "F0/0 F1/0 F0/2 F1/2 F2/0 B0/2 F3/0 B1/2 F2/2 B0/0"
    assert named(rank1[:8], stage=True) == "F0/1 F1/1 F0/3 B0/3 F1/3 B1/3 F2/1 B0/1"
    assert named([a for a in rank0 if a.kind == "F"], stage=True) == "F0/0 F1/0 F0/2 F1/2 F2/0 F3/0 F2/2 F3/2"
    assert named([a for a in rank0 if a.kind == "B"], stage=True) == "B0/2 B1/2 B0/0 B1/0 B2/2 B3/2 B2/0 B3/0"
    assert simulate(build("zbv", 2, 2)).ascii().splitlines() == [
        "rank 0:  F0a F1a   . F0b B0b F1b B1b B0a W0b B1a W1b W0a W1a",
        "rank 1:    . F0a F0b F1a F1b B0b B0a B1b B1a W0b W0a W1b W1a"]
