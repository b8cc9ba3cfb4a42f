"""benchmarks/bench_planner.py times plan()'s phases by wrapping the functions plan._build and
its simulator call; a refactor that moves one (the simulation moved to symmetry.py) must fail
here, not leave the planner_speed row FAILED in a benchmark run."""

from __future__ import annotations

import pytest

from benchmarks.bench_planner import PHASES, phase_timers, time_plan


def test_every_wrapped_phase_still_exists() -> None:
    for label, targets in PHASES.items():
        for module, name in targets:
            assert hasattr(module, name), f"{label}: {module.__name__}.{name} is gone"


@pytest.mark.parametrize("schedule, expected", [
    ("1f1b", ("placement_table", "priorities", "simulate", "lower", "dry_run", "measure")),
    # cap='auto': the bisection's simulations (and their priorities) run inside auto_cap
    ("interleaved", ("placement_table", "auto_cap", "simulate", "lower", "dry_run", "measure")),
])
def test_the_timers_see_every_phase(schedule: str, expected: tuple[str, ...]) -> None:
    from lightning_gsched.schedule.plan import plan

    with phase_timers() as (times, calls):
        plan(schedule, 4, stages=8, microbatches=8)
    for label in expected:
        assert calls[label] >= 1, label
    assert set(times) == set(PHASES)
    timed = time_plan(schedule, 4, 8, 8, 1)
    assert timed["valid"] and timed["simulations"] >= 1
