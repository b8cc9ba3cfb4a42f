"""Verified plans by the timeline argument (schedule/proof.py) against the full dry run.

Where :func:`certify` accepts a timeline, ``plan(verify=True)`` proves deadlock freedom once
and checks each rank's program as it is lowered; here, at small W for every schedule this
applies to (fsdp, fslpp, fslpp-seed; ddp, lpp and pipelines x data parallel, whose replicas
all-reduce; several B, split backwards, fetch windows, forward-only),
the fast verified plan's programs, timeline and metrics equal the full path's (every program
lowered and dry-run), the lemma's premise holds on the lowered programs themselves, anything
outside the argument (no symmetry, ties, replicated stages that are also fetched, a broken
renaming) is dry-run in full, and a
broken program is refused when its rank is lowered.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule import symmetry
from lightning_gsched.schedule.dryrun import Shared, check_rank, dry_run
from lightning_gsched.schedule.jobs import StageGraph
from lightning_gsched.schedule.lower import Lowering
from lightning_gsched.schedule.plan import Plan, plan
from lightning_gsched.schedule.program import SEND_OPS, Action, Op, Programs
from lightning_gsched.schedule.proof import certify

plan_module = sys.modules["lightning_gsched.schedule.plan"]  # the package exports plan()
FAST = ("fsdp", "fslpp", "fslpp-seed")
CASES: list[tuple[str, int, dict[str, Any]]] = [
    (name, W, kwargs)
    for name in FAST
    for W in (4, 8)
    for kwargs in ({}, {"microbatches": 2 * W}, {"split_backward": True},
                   {"fetch_window": 1}, {"forward_only": True}, {"cap": None})
] + [("fslpp", 8, {"R": 4}), ("fslpp", 8, {"R": 2, "microbatches": 16}),
     ("fsdp", 6, {"order": "1f1b"}), ("fslpp", 8, {"order": "zb", "split_backward": True})] + [
    # replicas (all-reduces after each owner's last gradient job): ddp, lpp, and pipelines x
    # data parallel, replicated or sharded
    ("ddp", 4, {}), ("ddp", 8, {"split_backward": True}), ("lpp", 8, {}), ("lpp", 6, {"R": 3}),
    ("1f1b", 8, {"data_parallel_size": 2}), ("zbv", 8, {"data_parallel_size": 2}),
    ("v-half", 8, {"data_parallel_size": 2}),
    ("interleaved", 8, {"data_parallel_size": 4}), ("zb-h2", 6, {"data_parallel_size": 3}),
    ("gpipe", 8, {"data_parallel_size": 2, "forward_only": True}),
    ("zb-h1", 8, {"data_parallel_size": 2, "data_parallel": "shard"}),
    ("1f1b", 6, {"data_parallel_size": 2, "data_parallel": "shard"}),
]


def _full(monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any) -> Plan:
    with monkeypatch.context() as m:
        m.setattr(plan_module, "certify", lambda *a: "the reference path")
        return plan(*args, **kwargs)


@pytest.mark.parametrize(("name", "W", "kwargs"), CASES)
def test_fast_verified_plan_equals_full_path(monkeypatch: pytest.MonkeyPatch, name: str, W: int,
                                             kwargs: dict[str, Any]) -> None:
    fast = plan(name, W, **kwargs)
    assert fast.programs.ranks.lowered == 0  # the argument applied: nothing lowered yet
    full = _full(monkeypatch, name, W, **kwargs)
    assert full.programs.ranks.lowered == W  # every program lowered and dry-run
    assert fast.timeline.start == full.timeline.start
    assert fast.timeline.order == full.timeline.order
    for rank in reversed(range(W)):
        assert fast.programs.ranks[rank] == full.programs.ranks[rank], rank
    assert fast.metrics == full.metrics
    assert [m.as_dict() for m in fast.metrics.per_worker] == \
        [m.as_dict() for m in full.metrics.per_worker]
    assert fast.to_json() == full.to_json()
    _assert_premise(full.programs, full)


def _assert_premise(programs: Programs, result: Plan) -> None:
    """The lemma's premise on real programs: each consumed message's send comes after no
    compute starting at or after the consumer's start (proof.py)."""
    timeline = result.timeline
    P, B = len(timeline.phases), result.micro
    phase_of = {Op.F: 0, Op.B: 1, Op.W: 2}
    shared = Shared(programs)
    sends: dict[int, list[float]] = {}  # channel -> per send, the latest compute start before
    starts: list[list[float]] = []
    for rank, program in enumerate(programs.ranks):
        latest, mine = -math.inf, []
        for action in program:
            op = action.op
            if op in phase_of:
                latest = timeline.start[(action.stage * B + action.micro) * P + phase_of[op]]
            elif op in SEND_OPS:
                channel = shared.base[op] + rank * programs.world_size + action.peer
                sends.setdefault(channel, []).append(latest)
            mine.append(latest)
        starts.append(mine)
    for rank, program in enumerate(programs.ranks):
        for event in check_rank(shared, rank).events:
            if isinstance(event, int):
                continue
            if len(event) == 4:  # an all-reduce: right after its last gradient job of the stage
                index, stage = event[0], program[event[0]].stage
                computes = [a for a in program[:index] if a.op in phase_of]
                grad = Op.W if programs.split_backward else Op.B
                assert computes[-1].op is grad and computes[-1].stage == stage
                assert not any(a.op is grad and a.stage == stage for a in program[index:])
                continue
            index, consumed = event
            t = starts[rank][index]
            for channel, k in consumed:
                assert sends[channel][k - 1] < t, (rank, program[index], channel, k)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("fslpp", {"data_parallel_size": 2}),  # replicated stages that are also fetched
    ("fsdp", {"ties": {0: (0, 3)}}),  # ties
    ("1f1b", {}), ("interleaved", {}),  # no group symmetry
    ("fslpp", {"R": 8}),  # one group
])
def test_outside_the_argument_dry_runs_in_full(monkeypatch: pytest.MonkeyPatch, name: str,
                                               kwargs: dict[str, Any]) -> None:
    calls: list[int] = []
    monkeypatch.setattr(plan_module, "dry_run", lambda p: calls.append(p.world_size) or dry_run(p))
    result = plan(name, 8, **kwargs)
    assert result.programs.ranks.lowered == 8 and calls == [8]


def test_custom_placement_dry_runs_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(plan_module, "dry_run", lambda p: calls.append(1) or dry_run(p))
    result = plan(None, 4, stages=4, microbatches=4, placement=lambda s, b, d: (s, b))
    assert result.programs.ranks.lowered == 4 and calls == [1]


@pytest.mark.parametrize("breakage", ["early", "overlap", "swap", "duplicate"])
def test_broken_renaming_falls_back_to_full_dry_run(monkeypatch: pytest.MonkeyPatch,
                                                    breakage: str) -> None:
    """A renaming that no longer gives a valid timeline is caught by certify: the plan then
    lowers and dry-runs every program (which may pass or refuse them)."""
    expand = symmetry.expand

    def broken(*args: Any, **kwargs: Any) -> Any:
        timeline = expand(*args, **kwargs)
        last = timeline.order[-1]
        if breakage == "early":  # a job of the last group before its predecessor ends
            timeline.start[last[1]] = timeline.start[last[0]]
        elif breakage == "overlap":  # a zero-length job
            timeline.end[last[2]] = timeline.start[last[2]]
        elif breakage == "swap":  # starts out of order along a worker
            last[1], last[2] = last[2], last[1]
        else:  # a job on two workers, another on none
            timeline.order[-1] = [timeline.order[0][0], *last[1:]]
        return timeline

    monkeypatch.setattr(symmetry, "expand", broken)
    calls: list[int] = []
    monkeypatch.setattr(plan_module, "dry_run", lambda p: calls.append(1) or dry_run(p))
    try:
        result = plan("fsdp", 4)
    except ProgramError:
        pass  # the full dry run refused the programs of the broken timeline
    else:
        assert result.programs.ranks.lowered == result.workers
    assert calls == [1]


def test_certify_names_why() -> None:
    result = plan("fsdp", 4, verify=False)
    graph = StageGraph(result.stages, None)
    assert certify(graph, result.table, result.timeline, None) is None
    assert "tied" in (certify(graph, result.table, result.timeline, {0: (0, 1)}) or "")
    fetched_replicas = plan("fslpp", 8, data_parallel_size=2, verify=False)
    assert "several owners and fetchers" in (certify(
        StageGraph(fetched_replicas.stages, None), fetched_replicas.table,
        fetched_replicas.timeline, None) or "")
    # replicas that end their last gradient job of a stage at different times
    replicated = plan("1f1b", 4, data_parallel_size=2, verify=False)
    graph = StageGraph(replicated.stages, None)
    assert certify(graph, replicated.table, replicated.timeline, None) is None
    end = list(replicated.timeline.end)
    last = max(range(1, len(end), 2), key=lambda j: end[j] if j // 2 // replicated.micro == 0
               else -1)  # stage 0's last backward
    end[last] += 0.5
    replicated.timeline.end = end
    assert "different times" in (certify(graph, replicated.table, replicated.timeline, None)
                                 or "")


def _tampered(monkeypatch: pytest.MonkeyPatch, edit: Any) -> None:
    original = Lowering.program_and_sends

    def program_and_sends(self: Lowering, rank: int) -> Any:
        program, sends = original(self, rank)
        return edit(rank, list(program), sends)

    monkeypatch.setattr(Lowering, "program_and_sends", program_and_sends)


def test_a_rank_program_failing_its_check_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def drop_fetch(rank: int, program: list[Action], sends: Any) -> Any:
        index = next(i for i, a in enumerate(program) if a.op is Op.FETCH_W)
        return program[:index] + program[index + 1:], sends

    _tampered(monkeypatch, drop_fetch)
    result = plan("fsdp", 4)
    with pytest.raises(ProgramError, match="rank 2"):
        result.programs.ranks[2]


def test_an_all_reduce_outside_the_argument_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An all-reduce moved before its rank's last gradient job of the stage: a member could
    wait there for a replica that waits for this rank, so the rank's check refuses it."""
    def early_all_reduce(rank: int, program: list[Action], sends: Any) -> Any:
        index = next(i for i, a in enumerate(program) if a.op is Op.ALLREDUCE_G)
        first_backward = next(i for i, a in enumerate(program)
                              if a.op is Op.B and a.stage == program[index].stage)
        moved = program[:index] + program[index + 1:]
        return moved[:first_backward] + [program[index]] + moved[first_backward:], sends

    _tampered(monkeypatch, early_all_reduce)
    result = plan("1f1b", 4, data_parallel_size=2)
    with pytest.raises(ProgramError, match="rank 1 .*an all-reduce not right after"):
        result.programs.ranks[1]


def test_a_channel_into_a_rank_that_does_not_match_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def drop_send(rank: int, program: list[Action], sends: Any) -> Any:
        channel = next(c for c in sorted(sends) if sends[c])
        return program, {**sends, channel: sends[channel][1:]}

    _tampered(monkeypatch, drop_send)
    result = plan("fslpp", 8)
    with pytest.raises(ProgramError, match="channel"):
        result.programs.ranks[1]


def test_readers_of_every_rank_take_the_full_path_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading ranks one by one lowers only those (however many); a reader of every rank says
    so (``make_all``: the per-worker rows' reader, the cost replay) and gets every program
    lowered and dry-run at once (lazy_ranks.py)."""
    calls: list[int] = []
    monkeypatch.setattr(plan_module, "dry_run", lambda p: calls.append(1) or dry_run(p))
    W = 16
    result = plan("fsdp", W)
    reference = _full(monkeypatch, "fsdp", W)
    calls.clear()
    lazy = result.programs.ranks
    assert lazy.lowered == 0
    for rank in range(W - 1):
        assert lazy[rank] == reference.programs.ranks[rank]
    assert lazy.lowered == W - 1 and calls == []  # one by one, never all at once by itself
    second = plan("fsdp", W).programs.ranks
    assert second.make_all() is second and second.lowered == W and calls == [1]
    assert second == reference.programs.ranks and calls == [1]
    rows = plan("fslpp", 8).metrics.per_worker  # the table's reader of every row
    rows.make_all()
    assert [m.as_dict() for m in rows] == [m.as_dict() for m in
                                          _full(monkeypatch, "fslpp", 8).metrics.per_worker]
    assert calls == [1, 1, 1]  # the lazy plan's one full pass (the rows), the reference's


def test_a_send_too_late_for_the_argument_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lemma's premise is checked on each rank's waits: a send placed (so its builder says)
    after the sender's last compute cannot prove the consumer's wait."""
    def late(rank: int, program: list[Action], sends: Any) -> Any:
        return program, {channel: [(ident, 10 ** 6 if channel[0] == "weights" else gap)
                                   for ident, gap in messages]
                         for channel, messages in sends.items()}

    _tampered(monkeypatch, late)
    result = plan("fsdp", 4)
    with pytest.raises(ProgramError, match="deadlock argument"):
        result.programs.ranks[1]


PIPELINES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "v-half")


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize(("name", "W", "kwargs"), [
    (name, W, kwargs) for name in PIPELINES for W in (2, 4, 6)
    for kwargs in ({}, {"microbatches": 3 * W}, {"forward_only": True})
] + [("1f1b", 4, {"split_backward": True}), ("gpipe", 4, {"stages": 8}),
     ("fsdp", 4, {"order": "interleaved"})])
def test_large_plans_without_symmetry_equal_full_path(
        monkeypatch: pytest.MonkeyPatch, name: str, W: int, kwargs: dict[str, Any],
        verify: bool) -> None:
    """Plans of LAZY_FROM_JOBS jobs or more (the pipelines at large W; here the threshold is
    0) are lowered per rank, neighbours' data flow only, and verified by the argument."""
    monkeypatch.setattr(plan_module, "LAZY_FROM_JOBS", 0)
    fast = plan(name, W, verify=verify, **kwargs)
    assert fast.programs.ranks.lowered == 0
    full = _full(monkeypatch, name, W, **kwargs)
    for rank in reversed(range(W)):
        assert fast.programs.ranks[rank] == full.programs.ranks[rank], rank
        assert fast.metrics.per_worker[rank].as_dict() == full.metrics.per_worker[rank].as_dict()
    assert fast.metrics.latency == full.metrics.latency
    assert fast.metrics.bubble_fraction == full.metrics.bubble_fraction
    _assert_premise(full.programs, full)


def test_a_rank_running_other_computes_than_its_order_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def swap(rank: int, program: list[Action], sends: Any) -> Any:
        i, j = (index for index, a in enumerate(program) if a.op is Op.F and a.stage < 2)
        program[i], program[j] = program[j], program[i]
        return program, sends

    _tampered(monkeypatch, swap)
    with pytest.raises(ProgramError, match="timeline order"):
        plan("fsdp", 4).programs.ranks[3]
