"""Property tests over random valid (schedule, W, S, B, R, order, cap, costs)."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_gsched.errors import CapTooSmallError
from lightning_gsched.schedule import Op, Phase, StageGraph, dry_run, plan
from lightning_gsched.schedule.program import COMPUTE_OPS

LOOPED = ["lpp", "fslpp", "fslpp-seed"]


@st.composite
def configs(draw):
    name = draw(st.sampled_from(["ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed"]))
    W = draw(st.integers(1, 6))
    R = None
    if name in LOOPED:
        R = draw(st.sampled_from([r for r in range(1, W + 1) if W % r == 0]))
    elif name == "interleaved":
        R = W
    unit_s = {"ddp": 1, "fsdp": W, "gpipe": W, "1f1b": W}.get(name, R)
    S = unit_s * draw(st.integers(1, 3))
    unit_b = {"ddp": W, "fsdp": W}.get(name, W // R if R else 1)
    B = unit_b * draw(st.integers(1, 4))
    orders = ["bfs", "1f1b"] + (["interleaved"] if R else [])
    order = draw(st.sampled_from(orders))
    cap = draw(st.one_of(st.none(), st.integers(1, 6), st.just("auto")))
    f = draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0]), min_size=S, max_size=S))
    b = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=S, max_size=S))
    fetch_window = draw(st.sampled_from([None, None, 1]))
    return dict(schedule=name, workers=W, stages=S, microbatches=B, R=R, order=order, cap=cap,
                forward_cost=f, backward_cost=b, fetch_window=fetch_window)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_every_plan_is_a_valid_schedule(config):
    try:
        result = plan(**config)
    except CapTooSmallError:
        assume(False)
        return
    W, S, B = result.workers, result.stages, result.micro
    graph = StageGraph(S)
    slots = result.timeline.slots
    by_job = {slot.job: slot for slot in slots}

    # every job runs exactly once, on its placement's compute worker, for its cost
    assert len(slots) == 2 * S * B == len(by_job)
    for slot in slots:
        s, b, d = slot.job
        assert slot.worker == result.table.compute[s][b]
        cost = config["forward_cost"][s] if d is Phase.F else config["backward_cost"][s]
        assert abs((slot.end - slot.start) - cost) < 1e-9
        # after its predecessors
        for pred in graph.pred(slot.job):
            assert by_job[pred].end <= slot.start + 1e-9

    # no two jobs overlap on a worker
    for worker_slots in result.timeline.by_worker:
        ordered = sorted(worker_slots, key=lambda x: x.start)
        for a, z in pairwise(ordered):
            assert a.end <= z.start + 1e-9

    # programs pass the dry run and carry the timeline's compute order
    dry_run(result.programs)
    for w in range(W):
        computes = [(a.stage, a.micro, a.op.value) for a in result.programs.ranks[w] if a.op in COMPUTE_OPS]
        timeline_order = [(x.job.stage, x.job.micro, x.job.phase.value) for x in result.timeline.by_worker[w]]
        assert computes == timeline_order

    # metrics agree with the timeline and with the seed's direct formulas
    metrics = result.metrics
    assert abs(metrics.latency - max(x.end for x in slots)) < 1e-9
    busy = defaultdict(float)
    for x in slots:
        busy[x.worker] += x.end - x.start
    for m in metrics.per_worker:
        w = m.worker
        assert abs(m.busy - busy[w]) < 1e-9
        seed_act_recvs = sum(
            1 for s in range(1, S) for b in range(B)
            if result.table.compute[s][b] == w and result.table.compute[s - 1][b] != w
        )
        assert m.activation_recvs == seed_act_recvs
        foreign = {x.job.stage for x in result.timeline.by_worker[w]} - set(result.table.owned_stages(w))
        assert m.weight_fetches >= len(foreign)
        assert m.grad_sends == sum(
            1 for a in result.programs.ranks[w] if a.op is Op.REDUCE_G
        ) and m.grad_sends >= len(foreign)
        cap = result.caps[w]
        if cap is not None:
            assert m.peak_activations <= cap
        assert m.peak_resident_stages >= m.owned_stages
        # fetched stages held at once: one computing plus one prefetched, or the window
        assert m.peak_resident_stages - m.owned_stages <= (config["fetch_window"] or 2)
    total = sum(busy.values())
    assert abs(metrics.bubble_fraction - (1 - total / (W * metrics.latency))) < 1e-9


@pytest.mark.parametrize("threshold", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("guess", [0, 1, 4, 8, 9, 16, 40])
def test_cap_search_from_a_guess_finds_the_bisection_answer(threshold, guess):
    from lightning_gsched.schedule.cap_search import search_from, smallest_passing

    calls = []

    def ok(c: int) -> bool:
        calls.append(c)
        return c >= threshold

    expected = smallest_passing(1, 16, lambda c: c >= threshold)
    assert search_from(1, 16, ok, guess) == expected == threshold
    if guess == threshold and 1 < guess < 16:
        assert calls == [guess, guess - 1]  # a right guess costs two simulations
