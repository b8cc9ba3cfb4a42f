"""Bad input gives a GschedError subclass whose message names the problem and the fix."""

from __future__ import annotations

import pytest

from lightning_gsched.errors import (
    CapTooSmallError,
    GschedError,
    PlacementError,
    ScheduleConfigError,
    UnknownScheduleError,
)
from lightning_gsched.schedule import Phase, plan


def test_r_not_dividing_workers():
    with pytest.raises(ScheduleConfigError, match=r"R=4 does not divide .* W=6; choose R among \[1, 2, 3, 6\]"):
        plan("lpp", workers=6, R=4)


def test_gpipe_with_fewer_stages_than_workers():
    with pytest.raises(ScheduleConfigError, match=r"gpipe: stages S=3 .* multiple of workers W=4.*use S=4"):
        plan("gpipe", workers=4, stages=3)


@pytest.mark.parametrize("name,kwargs,fix", [
    ("ddp", dict(workers=4, microbatches=6), "use B=8"),
    ("fsdp", dict(workers=4, stages=4, microbatches=5), "use B=8"),
    ("fsdp", dict(workers=4, stages=6, microbatches=4), "use S=8"),
    ("lpp", dict(workers=4, R=2, stages=4, microbatches=3), "use B=4"),
    ("fslpp", dict(workers=4, R=2, stages=3, microbatches=4), "use S=4"),
])
def test_microbatches_or_stages_not_a_required_multiple(name, kwargs, fix):
    with pytest.raises(ScheduleConfigError, match=fix):
        plan(name, **kwargs)


def test_unknown_schedule_name_suggests_close_matches():
    with pytest.raises(UnknownScheduleError, match=r"unknown schedule 'fslp'.*'fslpp'") as info:
        plan("fslp", workers=4)
    assert isinstance(info.value, GschedError) and isinstance(info.value, KeyError)


@pytest.mark.parametrize("kwargs", [dict(forward_cost=-1), dict(backward_cost=0), dict(forward_cost=[1, 2])])
def test_bad_costs(kwargs):
    with pytest.raises(ScheduleConfigError, match="cost"):
        plan("gpipe", workers=4, **kwargs)


def test_cap_too_small_is_detected_not_looped_on():
    with pytest.raises(CapTooSmallError, match=r"cannot make progress.*smallest uniform cap that completes this schedule is 3"):
        plan("lpp", workers=4, R=2, stages=4, microbatches=8, order="1f1b", cap=1)


@pytest.mark.parametrize("cap", [0, -2, [1, 2], "lots", True])
def test_invalid_cap_values(cap):
    with pytest.raises(ScheduleConfigError):
        plan("1f1b", workers=4, cap=cap)


def test_unknown_order():
    with pytest.raises(ScheduleConfigError, match="unknown order 'random'"):
        plan("gpipe", workers=2, order="random")


def test_custom_placement_out_of_range():
    with pytest.raises(PlacementError, match=r"returned compute worker 4; workers must be ints in \[0, 4\)"):
        plan(placement=lambda s, b, d: (0, 4), workers=4, stages=2, microbatches=2)


def test_custom_placement_splitting_forward_and_backward():
    def split(s, b, d):
        return (0, 0) if d is Phase.F else (1, 1)

    with pytest.raises(PlacementError, match=r"F s0 b0 on worker 0 but B s0 b0 on worker 1"):
        plan(placement=split, workers=2, stages=1, microbatches=1)


def test_custom_placement_not_returning_a_pair():
    with pytest.raises(PlacementError, match="must return a pair"):
        plan(placement=lambda s, b, d: 3, workers=4, stages=2, microbatches=2)


def test_custom_placement_fetching_one_stage_from_two_owners():
    with pytest.raises(PlacementError, match="from a single owner"):
        plan(placement=lambda s, b, d: (1 + b % 2, 0), workers=3, stages=1, microbatches=2)


def test_custom_schedule_needs_sizes():
    with pytest.raises(ScheduleConfigError, match="explicit stages= and microbatches="):
        plan(placement=lambda s, b, d: (0, 0), workers=1)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "gpipe", "1f1b"])
def test_r_on_a_schedule_without_groups(name):
    with pytest.raises(ScheduleConfigError, match=f"{name} has no R parameter"):
        plan(name, workers=4, R=2)


def test_incomparable_priorities():
    with pytest.raises(ScheduleConfigError, match="mutually comparable"):
        plan("gpipe", workers=2, order=lambda s, b, d: "x" if s else 1)
