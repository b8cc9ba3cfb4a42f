"""The timeline by group symmetry (schedule/symmetry.py) equals the full simulation exactly.

Every field of the timeline (start, end, per-worker order, busy sums, the placement order) is
compared at small W over the looped family, the library orders, split and plain backwards,
caps, uneven stage costs and several B; and a plan through the fast path equals the same plan
built from a custom placement (which always simulates in full). No timing here (benchmarks).
"""

from __future__ import annotations

import pytest

from lightning_gsched.errors import CapTooSmallError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.jobs import StageGraph
from lightning_gsched.schedule.library import get_schedule, resolve_shape
from lightning_gsched.schedule.orders import bfs, gpipe, one_f_one_b, zero_bubble
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.priorities import priority_ranks
from lightning_gsched.schedule.simulate import Costs, Timeline, simulate
from lightning_gsched.schedule.symmetry import groups_of, make_simulator, symmetric

FIELDS = ("workers", "stages", "micro", "phases", "start", "end", "order", "busy", "sequence")


def _cases() -> list[tuple[str, int, int | None]]:
    cases: list[tuple[str, int, int | None]] = []
    for name in ("ddp", "fsdp", "lpp", "fslpp", "fslpp-seed"):
        for W in (2, 4, 6, 8):
            Rs = [None] if name in ("ddp", "fsdp") else [r for r in (1, 2, 4) if W % r == 0]
            cases += [(name, W, R) for R in Rs]
    return cases


def _timelines(name: str, W: int, R: int | None, order: object, split: bool,
               cap: int | None, scale: int) -> tuple[Timeline | type, Timeline | type]:
    spec = get_schedule(name)
    S, B, R = resolve_shape(name, W, None, None, R)
    B *= scale
    placement = spec.make_placement(W, S, R or 1)
    table = PlacementTable(placement, W, S, B)
    graph = StageGraph(S, None, split_backward=split)
    costs = Costs.build(S, [1 + s % 3 for s in range(S)], 2.5, None, split)
    out: list[Timeline | type] = []
    for run in (lambda caps: simulate(graph, table, priority_ranks(order, S, B, False, split),  # type: ignore[arg-type]
                                      costs, caps),
                make_simulator(graph, table, placement, order, costs)):  # type: ignore[arg-type]
        try:
            out.append(run([cap] * W))
        except CapTooSmallError as exc:
            out.append(type(exc))
    return out[0], out[1]


def _plain(value: object) -> object:
    """A timeline field as the simulator's lists (a pipeline's sweep keeps ``array('d')``
    times and per-worker orders made when read: sweep.py)."""
    if isinstance(value, (str, int, tuple)) or not hasattr(value, "__len__"):
        return value
    return [_plain(item) if hasattr(item, "__len__") else item for item in value]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name,W,R", _cases())
@pytest.mark.parametrize("order", [bfs, gpipe, one_f_one_b, zero_bubble])
def test_the_timeline_by_symmetry_is_the_full_simulation(name: str, W: int, R: int | None,
                                                         order: object) -> None:
    for split, cap, scale in ((False, None, 1), (True, None, 2), (False, 2, 1), (True, 1, 1)):
        full, fast = _timelines(name, W, R, order, split, cap, scale)
        if isinstance(full, type):
            assert fast is full  # a cap too small fails the same way
            continue
        assert isinstance(fast, Timeline)
        for field in FIELDS:
            assert _plain(getattr(fast, field)) == getattr(full, field), (split, cap, scale,
                                                                          field)
        assert fast.slots == full.slots


def test_what_has_no_fast_path() -> None:
    """Pipelines, custom placements and orders, caps that do not repeat per group: in full."""
    spec = get_schedule("fslpp")
    placement = spec.make_placement(8, 8, 2)
    groups = groups_of(placement, bfs, 8, 8)
    assert groups is not None and groups.count == 4
    assert symmetric(groups, [3] * 8)
    assert groups_of(placement, lambda s, b, d: (s, b), 8, 8) is None  # no written-out layout
    assert not symmetric(groups, [3, 2] + [3] * 6)  # caps differ between groups
    assert symmetric(groups, [3, 2] * 4)  # ... but may differ inside one
    assert groups_of(get_schedule("1f1b").make_placement(8, 8, 8), bfs, 8, 8) is None
    assert groups_of(lambda s, b, d: (0, b % 8), bfs, 8, 8) is None
    assert groups_of(get_schedule("lpp").make_placement(8, 8, 8), bfs, 8, 8) is None  # G = 1


@pytest.mark.parametrize("name,W,R", [("fsdp", 4, None), ("fslpp", 8, 2), ("lpp", 6, 3),
                                      ("ddp", 4, None), ("fslpp-seed", 4, 2)])
@pytest.mark.parametrize("cap", ["default", "auto", None])
def test_a_plan_by_symmetry_equals_the_full_construction(name: str, W: int, R: int | None,
                                                         cap: object) -> None:
    """The same plan with its placement passed as a custom callable (always in full)."""
    fast = plan(name, W, R=R, cap=cap)  # type: ignore[arg-type]
    library = get_schedule(name).make_placement(W, fast.stages, fast.R or 1)
    full = plan(name, W, fast.stages, fast.micro, order="bfs",
                cap=fast.caps if cap != "auto" else "auto",
                placement=lambda s, b, d: library(s, b, d))
    for field in FIELDS:
        assert getattr(fast.timeline, field) == getattr(full.timeline, field), field
    assert fast.caps == full.caps
    assert fast.programs.ranks == full.programs.ranks
    assert fast.metrics == full.metrics
