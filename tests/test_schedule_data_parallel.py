"""Pipelines x data parallel (schedule/data_parallel.py): one combinator, exact, for every schedule.

What is checked, with no timing (the planner benchmarks time it):
- a lifted plan (by symmetry: one replica planned, the others renamed) equals the same lift
  passed as a custom placement and priority, which the planner simulates in full: every
  timeline field, every program, every metric; for every library pipeline, P = 2 and 3,
  G = 2 and 3, both modes, and a user's own two callables;
- each rank of a G-replica plan stashes what its position stashes in the P-worker plan (the
  default cap is kept: the issue's hand-written 2 x 2 lost it), with the same latency;
- the looped family is this lift with a replica-contiguous layout (lpp, fslpp, ddp, fsdp);
- replicate: each stage all-reduced once per step over its column, right after the owner's
  last gradient job; shard: each stage owned once and balanced over its column, fetched once
  per step by the others, held to its last job and its gradient reduced once;
- bad input: a ScheduleConfigError naming the values and the valid choices.
"""

from __future__ import annotations

import pytest

from lightning_gsched.errors import PlacementError, ScheduleConfigError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.data_parallel import DataParallel, lift
from lightning_gsched.schedule.jobs import Phase
from lightning_gsched.schedule.library import get_schedule
from lightning_gsched.schedule.placements import DDP, FSDP, FSLPP, LPP, GPipe
from lightning_gsched.schedule.program import Op
from lightning_gsched.schedule.replicas import ReplicaLayout

PIPELINES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "v-half", "lpp",
             "fslpp"]
TIMELINE = ("start", "end", "order", "busy", "sequence")


def _plain(value: object) -> object:
    """A timeline field as plain lists (a sweep keeps array('d') times, lazy worker orders)."""
    if isinstance(value, (str, int, float, tuple)) or not hasattr(value, "__len__"):
        return value
    return [_plain(item) for item in value]  # type: ignore[attr-defined]


def _lifted(name: str, W: int, G: int, mode: str, **extra: object):  # type: ignore[no-untyped-def]
    try:
        return plan(name, W, data_parallel_size=G, data_parallel=mode, **extra)  # type: ignore[arg-type]
    except ScheduleConfigError:
        return None


def _cases() -> list[tuple[str, int, int, str]]:
    return [(name, P, G, mode) for name in PIPELINES for P in (2, 3) for G in (2, 3)
            for mode in ("replicate", "shard")]


@pytest.mark.parametrize("name,P,G,mode", _cases())
def test_a_lifted_plan_equals_its_full_simulation(name: str, P: int, G: int, mode: str) -> None:
    fast = _lifted(name, P * G, G, mode)
    if fast is None:
        assert mode == "shard" and name == "lpp"  # lpp replicates its stages: refused
        return
    assert fast.timeline.replicas is not None  # planned as one replica, renamed
    lifted = _rebuild(fast)
    priority = _priority_of(name, fast)

    def custom(s: int, b: int, d: Phase) -> tuple[int, int]:  # a user's callable
        return lifted(s, b, d)

    def order(s: int, b: int, d: Phase) -> object:  # a user's callable: no fast path knows it
        return priority(s, b, d)

    # what a user's placement says to be held for the step, as the sharded lift does
    custom.hold_fetched_for_step = lifted.hold_fetched_for_step  # type: ignore[attr-defined]
    # and the cap rule of the V schedules (reserve.py), which the lift reads through
    custom.reserves_stash = lifted.reserves_stash  # type: ignore[attr-defined]
    full = plan(name, fast.workers, fast.stages, fast.micro, placement=custom, priority=order,
                cap=fast.caps, split_backward=fast.programs.split_backward)
    assert full.timeline.replicas is None
    for field in TIMELINE:
        assert _plain(getattr(fast.timeline, field)) == _plain(getattr(full.timeline, field)), \
            field
    assert list(fast.programs.ranks) == list(full.programs.ranks)
    assert list(fast.metrics.per_worker) == list(full.metrics.per_worker)
    assert isinstance(lifted, DataParallel) and lifted.shard == (mode == "shard")


def _rebuild(p: object) -> DataParallel:
    """The placement the plan was built from, lifted again from the P-worker schedule."""
    name, G, mode = p.schedule, p.data_parallel_size, p.data_parallel  # type: ignore[attr-defined]
    P = p.pipeline_size  # type: ignore[attr-defined]
    spec = get_schedule(name)
    inner = spec.make_placement(P, p.stages, p.R or 1)  # type: ignore[attr-defined]
    return lift(inner, ReplicaLayout(P, G), p.stages, p.micro // G, mode)  # type: ignore[attr-defined]


def _priority_of(name: str, p: object):  # type: ignore[no-untyped-def]
    """The priority the plan ran with: a library order itself (monotone in b, so it orders
    each replica's jobs as n_P(s, b // G, d) does), interleaved's positions lifted."""
    from lightning_gsched.schedule.data_parallel import lift_priority
    from lightning_gsched.schedule.orders import resolve_order

    spec = get_schedule(name)
    P, G = p.pipeline_size, p.data_parallel_size  # type: ignore[attr-defined]
    inner = resolve_order(spec.order, P, p.stages, p.micro // G, p.R)  # type: ignore[attr-defined]
    return lift_priority(inner, G)


@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize("P,G", [(2, 2), (4, 2), (3, 3)])
def test_each_replica_stashes_what_its_position_stashes(name: str, P: int, G: int) -> None:
    """plan(NAME, workers=P*G, data_parallel_size=G) is G copies of plan(NAME, workers=P)."""
    one = plan(name, P)
    many = plan(name, P * G, data_parallel_size=G)
    assert (many.pipeline_size, many.stages, many.micro) == (P, one.stages, one.micro * G)
    assert many.metrics.latency == one.metrics.latency
    layout = many.replicas
    for rank in range(P * G):
        mine, theirs = many.metrics.per_worker[rank], one.metrics.per_worker[layout.position(rank)]
        assert mine.peak_activations == theirs.peak_activations, (name, rank)
        assert many.caps[rank] == one.caps[layout.position(rank)]
    # the hand-written 2 x 2 1F1B (w = (b mod 2) * 2 + s) lost the cap; the lift keeps it
    if name == "1f1b" and (P, G) == (2, 2):
        assert [m.peak_activations for m in many.metrics.per_worker] == [2, 2, 1, 1]


def test_the_looped_family_is_the_lift_with_replica_contiguous_ranks() -> None:
    """lpp, fslpp, ddp and fsdp equal the combinator's placement on rank g*P + p."""
    for W, R in ((4, 2), (8, 2), (6, 3), (8, 4)):
        G = W // R
        layout = ReplicaLayout(R, G, pipeline_major=False)
        S, B = 2 * R * 2, 2 * W
        cases = [(LPP(W, R), lift(LPP(R, R), layout, S, B // G)),
                 (FSLPP(W, R), lift(LPP(R, R), layout, S, B // G, "shard"))]
        one = ReplicaLayout(1, W, pipeline_major=False)
        cases += [(DDP(W), lift(DDP(1), one, S, B // W)),
                  (FSDP(W), lift(DDP(1), one, S, B // W, "shard"))]
        for library, lifted in cases:
            for s in range(S):
                for b in range(B):
                    for d in (Phase.F, Phase.B):
                        assert library(s, b, d) == lifted(s, b, d), (library, s, b, d)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "interleaved"])
def test_replicate_all_reduces_each_stage_once_after_its_last_gradient(name: str) -> None:
    p = plan(name, 8, data_parallel_size=2)
    layout = p.replicas
    grad_op = Op.W if p.programs.split_backward else Op.B
    for rank, program in enumerate(p.programs.ranks):
        reduces = [(i, a) for i, a in enumerate(program) if a.op is Op.ALLREDUCE_G]
        stages = sorted(a.stage for _, a in reduces)
        assert stages == sorted(p.table.computed_stages(rank))  # each of its stages, once
        for i, action in reduces:
            assert sorted(action.group) == layout.column(layout.position(rank))
            last = max(j for j, a in enumerate(program)
                       if a.op is grad_op and a.stage == action.stage)
            # nothing but communication between the last gradient job and the all-reduce
            assert all(a.op not in (Op.F, Op.B, Op.W) for a in program[last + 1:i])
        assert not any(a.op is Op.FETCH_W for a in program)  # nothing is fetched


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h2", "zbv", "interleaved", "fslpp"])
@pytest.mark.parametrize("P,G", [(2, 2), (2, 4), (3, 2)])
def test_shard_owns_each_stage_once_and_fetches_it_once_per_step(name: str, P: int,
                                                                 G: int) -> None:
    p = plan(name, P * G, data_parallel_size=G, data_parallel="shard")
    layout = p.replicas
    assert all(len(owners) == 1 for owners in p.table.owners)
    owned = [len(p.table.owned_stages(rank)) for rank in range(P * G)]
    assert max(owned) - min(owned) <= 1  # balanced over every column
    for rank, program in enumerate(p.programs.ranks):
        mine = set(p.table.owned_stages(rank))
        computed = p.table.computed_stages(rank)
        for stage in computed - mine:
            fetches = [i for i, a in enumerate(program) if a.op is Op.FETCH_W and a.stage == stage]
            frees = [i for i, a in enumerate(program) if a.op is Op.FREE_W and a.stage == stage]
            reduces = [a for a in program if a.op is Op.REDUCE_G and a.stage == stage]
            assert len(fetches) == len(frees) == len(reduces) == 1, (rank, stage)
            jobs = [i for i, a in enumerate(program)
                    if a.op in (Op.F, Op.B, Op.W) and a.stage == stage]
            assert fetches[0] < jobs[0] and frees[0] > jobs[-1]  # held from first to last job
            owner = p.table.owners[stage][0]
            assert layout.position(owner) == layout.position(rank)  # fetched in its column
        assert not any(a.op is Op.ALLREDUCE_G for a in program)  # one owner: no all-reduce


def test_a_users_two_callables_are_lifted_too() -> None:
    """placement= and priority= describe a P-worker schedule; G replicas of it are planned."""

    def mine(s: int, b: int, d: Phase) -> tuple[int, int]:
        return s % 2, (s // 2 + b) % 2  # the P=2 custom schedule of the equivalence tests

    def urgency(s: int, b: int, d: Phase) -> tuple[int, int]:
        return (b, s)

    one = plan("mine", 2, 4, 4, placement=mine, priority=urgency)
    two = plan("mine", 4, 4, 4, placement=mine, priority=urgency, data_parallel_size=2)
    assert two.micro == 8 and two.timeline.replicas is not None
    assert two.metrics.latency == one.metrics.latency
    for rank in range(4):
        position = two.replicas.position(rank)
        assert two.metrics.per_worker[rank].busy == one.metrics.per_worker[position].busy
    with pytest.raises(PlacementError, match="worker 5"):  # the P-worker callable is checked
        plan("bad", 4, 2, 2, placement=lambda s, b, d: (5, 0), data_parallel_size=2)


def test_library_placements_and_custom_ones_agree_on_rows() -> None:
    """The lifted placement's table (rows read once per distinct row) equals a per-job table."""
    from lightning_gsched.schedule.placements import PlacementTable

    for inner, mode in ((GPipe(2, 12), "shard"), (GPipe(3, 12), "replicate"),
                        (LPP(4, 2), "replicate"), (FSLPP(4, 2), "shard")):
        layout = ReplicaLayout(inner.workers, 3)
        lifted = lift(inner, layout, 12, 4, mode)
        fast = PlacementTable(lifted, layout.workers, 12, 12)
        slow = PlacementTable(lambda s, b, d, lifted=lifted: lifted(s, b, d), layout.workers,
                              12, 12)
        assert (fast.compute, fast.weights, fast.owners, fast.fetch_source) == \
            (slow.compute, slow.weights, slow.owners, slow.fetch_source)
        assert fast.hold_fetched_for_step == (mode == "shard")
        assert not slow.hold_fetched_for_step  # a plain callable: per run, unless it says so


def test_the_replica_layout() -> None:
    layout = ReplicaLayout(4, 2)
    assert [layout.rank(p, g) for g in range(2) for p in range(4)] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert layout.members(1) == [1, 3, 5, 7] and layout.column(2) == [4, 5]
    assert all(layout.rank(layout.position(r), layout.replica(r)) == r for r in range(8))
    looped = ReplicaLayout(4, 2, pipeline_major=False)
    assert looped.members(1) == [4, 5, 6, 7] and looped.column(2) == [2, 6]


@pytest.mark.parametrize("kwargs,match", [
    ({"schedule": "1f1b", "workers": 8, "data_parallel_size": 3},
     r"data_parallel_size=3 does not divide the W=8 .*among \[1, 2, 4, 8\]"),
    ({"schedule": "ddp", "workers": 4, "data_parallel_size": 2},
     r"'ddp' is data parallel over all W ranks already.*1f1b"),
    ({"schedule": "fsdp", "workers": 4, "data_parallel_size": 2}, r"'fsdp' is data parallel"),
    ({"schedule": "lpp", "workers": 8, "data_parallel_size": 2, "data_parallel": "shard"},
     r"stage 0 has 2 owners in the 4-worker schedule.*fslpp"),
    ({"schedule": "1f1b", "workers": 4, "data_parallel": "shard"},
     r"data_parallel_size=1 has one replica"),
    ({"schedule": "1f1b", "workers": 4, "data_parallel_size": 2, "data_parallel": "zero3"},
     r"data_parallel='zero3' is not valid: must be one of \['replicate', 'shard'\]"),
    ({"schedule": "1f1b", "workers": 4, "data_parallel_size": 0},
     r"data_parallel_size=0 is not valid: must be a positive integer"),
    ({"schedule": "zbv", "workers": 4, "stages": 6, "data_parallel_size": 2},
     r"each replica runs the schedule on P = W / data_parallel_size = 2 workers: a V "
     r"placement \(zbv, v-half, v-min\): stages S=6 must be a positive multiple of 2W=4"),
    ({"schedule": "1f1b", "workers": 4, "cap": [1, 2, 3, 4], "data_parallel_size": 2},
     r"cap list has 4 entries but there are W=2 workers"),
    ({"schedule": "1f1b", "workers": 4, "data_parallel_size": 2, "data_parallel": "shard",
      "checkpoint_activations": [True, False]},
     r"needs S=4 values.*data_parallel='shard' grew the schedule's default S to 4.*stages="),
])
def test_bad_input_names_the_values_and_the_choices(kwargs: dict, match: str) -> None:
    with pytest.raises(ScheduleConfigError, match=match):
        plan(**kwargs)


def test_microbatches_count_one_replica_and_caps_are_the_replicas() -> None:
    p = plan("1f1b", 8, microbatches=6, cap=[3, 2, 2, 1], data_parallel_size=2)
    assert p.micro == 12 and p.caps == [3, 3, 2, 2, 2, 2, 1, 1]
    assert plan("1f1b", 8, data_parallel_size=2).to_json()["data_parallel_size"] == 2


def test_large_w_plans_one_replica_and_lowers_one_rank() -> None:
    """W=1024 as P=16 x G=64: the timeline is one replica's renamed, and reading rank 512's
    program lowers that rank alone (the benchmarks time it)."""
    p = plan("1f1b", 1024, data_parallel_size=64)
    assert p.timeline.replicas == ReplicaLayout(16, 64)
    program = p.programs.ranks[512]
    assert sum(a.op is Op.F for a in program) == p.micro // 64
    assert sum(a.op is Op.ALLREDUCE_G for a in program) == 1
    made = getattr(p.programs.ranks, "made", None)
    if made is not None:
        assert made <= 2


def test_gsched_plan_shows_what_sharding_saves_against_replicating() -> None:
    """With stage bytes, a sharded plan's text says each rank's owned bytes at rest against
    the same placement replicated (where a rank owns every stage it computes), and the bytes
    model agrees: the sharded plan's ranks hold less at rest."""
    from lightning_gsched.schedule.describe import describe
    from lightning_gsched.schedule.memory import resident_bytes

    sharded = plan("1f1b", 4, data_parallel_size=2, data_parallel="shard")
    replicated = plan("1f1b", 4, stages=sharded.stages, data_parallel_size=2)
    stage_bytes = [1000 * (s + 1) for s in range(sharded.stages)]
    line = describe(sharded, stage_bytes).splitlines()[2]
    assert line.startswith("sharded over 2 replicas: each rank owns")
    ours = resident_bytes(sharded.programs, stage_bytes)
    theirs = resident_bytes(replicated.programs, stage_bytes)
    assert max(r.owned for r in ours) < max(r.owned for r in theirs)
    saved = 1 - max(r.owned for r in ours) / max(r.owned for r in theirs)
    assert f"{saved:.0%} less on the largest rank" in line
    assert "sharded over" not in describe(replicated, stage_bytes)


def test_a_fetch_window_below_the_stages_a_sharded_rank_holds_is_refused() -> None:
    """Sharded, a rank holds every stage it fetches for the step (3 at G=4): a window of 1 or
    2 would make a fetch wait for a free at the step's end; a window of 3 is the plan itself."""
    for window in (1, 2):
        with pytest.raises(ScheduleConfigError, match=rf"fetch_window={window} is not valid "
                           r"with data_parallel='shard'.*\(3 here\).*at least 3"):
            plan("1f1b", 8, data_parallel_size=4, data_parallel="shard", fetch_window=window)
    held = plan("1f1b", 8, data_parallel_size=4, data_parallel="shard", fetch_window=3)
    plain = plan("1f1b", 8, data_parallel_size=4, data_parallel="shard")
    assert held.programs.ranks[0] == plain.programs.ranks[0]


def test_per_worker_and_per_stage_lists_under_replicas_say_what_they_count() -> None:
    """Under data_parallel_size a cap list is per worker of each replica, and a per-stage list
    counts the S that data_parallel='shard' grew: each error says so, also at a front end's
    setup check (it talked of "W=2 workers" on a 4-rank job, and of S=4 with no word of the
    growth there; found by probing)."""
    from lightning_gsched import GeneralParallel

    with pytest.raises(ScheduleConfigError, match=r"each replica runs the schedule on P = W / "
                                                  r"data_parallel_size = 2 workers: cap list has "
                                                  r"4 entries"):
        plan("1f1b", workers=4, data_parallel_size=2, cap=[4, 3, 2, 1])
    strategy = GeneralParallel("1f1b", data_parallel_size=2, data_parallel="shard",
                               checkpoint_activations=[True, False])
    with pytest.raises(ScheduleConfigError, match=r"needs S=4 values.*data_parallel='shard' "
                                                  r"grew the schedule's default S to 4"):
        strategy.schedule_config.check(4)
