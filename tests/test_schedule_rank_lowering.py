"""One rank's program lowered alone (schedule/lower.py: Lowering.programs of one rank) is the full lowering's, exactly.

Every rank of every library schedule at small W (timelines by symmetry and in full), with and
without ties, fetch windows, forward-only, several B and R, a custom placement and a stage DAG;
and a plan whose programs are lowered per rank on demand (``verify=False`` with a timeline by
symmetry) equals the eager plan in programs and metrics. No timing here (benchmarks).
"""

from __future__ import annotations

import pytest

from lightning_gsched.schedule import plan
from lightning_gsched.schedule.jobs import StageGraph
from lightning_gsched.schedule.lazy_ranks import LazyList
from lightning_gsched.schedule.lower import Lowering, lower
from lightning_gsched.schedule.orders import bfs
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.plan import Plan
from lightning_gsched.schedule.priorities import priority_ranks
from lightning_gsched.schedule.simulate import Costs, simulate

LIBRARY_NAMES = ("ddp", "fsdp", "lpp", "fslpp", "fslpp-seed", "gpipe", "1f1b", "interleaved",
                 "zb-h1", "zbv")


def _graph(result: Plan) -> StageGraph:
    return StageGraph(result.stages, None, forward_only=result.programs.forward_only,
                      split_backward=result.programs.split_backward)


def _assert_every_rank(result: Plan, fetch_window: int | None = None) -> None:
    lowering = Lowering(_graph(result), result.table, result.timeline, fetch_window,
                            result.programs.ties)
    full = lower(_graph(result), result.table, result.timeline, fetch_window,
                 result.programs.ties).ranks
    for rank in reversed(range(result.workers)):  # any order: nothing depends on it
        assert lowering.program(rank) == full[rank], rank


@pytest.mark.parametrize("name", LIBRARY_NAMES)
@pytest.mark.parametrize("W", [2, 3, 4, 6])
@pytest.mark.parametrize("fetch_window", [None, 1])
@pytest.mark.parametrize("forward_only", [False, True])
def test_one_rank_lowered_alone_is_the_full_lowering(name: str, W: int,
                                                     fetch_window: int | None,
                                                     forward_only: bool) -> None:
    try:
        result = plan(name, W, fetch_window=fetch_window, forward_only=forward_only,
                      verify=False)
    except Exception:  # noqa: BLE001 - shapes a schedule refuses (zbv at W=3 ...)
        pytest.skip("shape refused")
    _assert_every_rank(result, fetch_window)
    if result.stages >= 3:
        tied = plan(name, W, fetch_window=fetch_window, forward_only=forward_only,
                    ties={0: (0, result.stages - 1)}, verify=False)
        _assert_every_rank(tied, fetch_window)


@pytest.mark.parametrize("name,W,R", [("fslpp", 8, 2), ("fslpp", 8, 4), ("lpp", 6, 2),
                                      ("fslpp-seed", 4, 2), ("fsdp", 4, None), ("ddp", 6, None)])
@pytest.mark.parametrize("scale", [2, 3])
def test_several_microbatches_per_group(name: str, W: int, R: int | None, scale: int) -> None:
    base = plan(name, W, R=R, verify=False)
    result = plan(name, W, base.stages, base.micro * scale, R=R, verify=False,
                  cap=None if scale == 3 else "default")
    assert result.timeline.replicas is not None
    _assert_every_rank(result)
    _assert_every_rank(plan(name, W, base.stages, base.micro * scale, R=R, verify=False,
                            fetch_window=2, split_backward=True), 2)


def test_a_custom_placement_and_a_stage_dag() -> None:
    result = plan(None, 3, 6, 6, placement=lambda s, b, d: (s % 3, (s + b) % 3),
                  order="1f1b", verify=False, cap=None)
    assert result.timeline.replicas is None
    _assert_every_rank(result)
    # a stage DAG (plan() refuses it until the runtime runs one; the lowering follows it)
    edges = [(0, 1), (0, 2), (1, 3), (2, 3)]
    graph = StageGraph(4, edges)
    table = PlacementTable(lambda s, b, d: (s % 2, b % 2), 2, 4, 4)
    timeline = simulate(graph, table, priority_ranks(bfs, 4, 4), Costs.build(4), [None] * 2)
    lowering = Lowering(graph, table, timeline)
    full = lower(graph, table, timeline).ranks
    assert [lowering.program(rank) for rank in range(2)] == full


@pytest.mark.parametrize("name,W,R", [("fsdp", 4, None), ("fslpp", 8, 2), ("ddp", 4, None),
                                      ("lpp", 6, 3), ("fslpp-seed", 4, 2)])
@pytest.mark.parametrize("ties", [None, "first-last"])
def test_a_plan_lowered_on_demand_equals_the_eager_plan(name: str, W: int, R: int | None,
                                                        ties: str | None) -> None:
    S = plan(name, W, R=R).stages
    tie_map = {0: (0, S - 1)} if ties and S >= 2 else None
    eager = plan(name, W, R=R, ties=tie_map)
    lazy = plan(name, W, R=R, ties=tie_map, verify=False)
    assert isinstance(lazy.programs.ranks, LazyList)
    assert lazy.programs.ranks.lowered == 0  # nothing built until read
    assert lazy.programs.ranks[W - 1] == eager.programs.ranks[W - 1]
    assert lazy.programs.ranks.lowered == 1
    assert isinstance(lazy.metrics.per_worker, LazyList)
    assert lazy.metrics.per_worker[0] == eager.metrics.per_worker[0]
    assert lazy.metrics == eager.metrics
    assert lazy.programs == eager.programs  # every rank, and the facts beside them
    assert lazy.programs.text() == eager.programs.text()
    assert lazy.to_json() == eager.to_json()


def test_the_lazy_list_behaves_as_the_list() -> None:
    made: list[int] = []

    def make(i: int) -> list[int]:
        made.append(i)
        return [i] * i

    lazy = LazyList(4, make)
    assert len(lazy) == 4 and made == []
    assert lazy[-1] == [3, 3, 3] and lazy[3] is lazy[-1] and made == [3]
    assert lazy[1:3] == [[1], [2, 2]]
    assert list(lazy) == [[], [1], [2, 2], [3, 3, 3]] and sorted(made) == [0, 1, 2, 3]
    assert lazy == [[], [1], [2, 2], [3, 3, 3]] and lazy != [[], [1]]
    with pytest.raises(IndexError):
        lazy[4]
    with pytest.raises(TypeError):
        hash(lazy)


def test_reading_items_one_by_one_never_switches_to_make_all() -> None:
    """A bounded reader (the text table's shown workers) makes only the items it reads, each
    alone, however many; ``make_all`` is the explicit reader of every item, made once."""
    made: list[int] = []
    everything: list[str] = []

    def make_all() -> list[int]:
        everything.append("all")
        return list(range(100))

    source = LazyList(100, lambda i: made.append(i) or i, make_all)
    derived = LazyList(100, lambda i: -source[i], lambda: [-i for i in source])
    wanted = [*range(12), 99]
    assert [derived[i] for i in wanted] == [-i for i in wanted]
    assert everything == [] and made == wanted  # each made once, alone
    assert source.lowered == derived.lowered == len(wanted)
    assert derived[3] == -3 and derived[-1] == -99 and made == wanted  # kept
    assert source.make_all() is source and everything == ["all"] and made == wanted
    assert list(source) == list(range(100)) and source.make_all() and everything == ["all"]

