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


@pytest.mark.parametrize("schedule, cap, expected", [
    # a pipeline: its keys and its sweep (sweep.py)
    ("1f1b", None, ("placement_table", "priorities", "simulate", "lower", "dry_run", "measure")),
    # cap='auto': the bisection's simulations (and their priorities) run inside auto_cap
    ("interleaved", "auto",
     ("placement_table", "auto_cap", "simulate", "lower", "dry_run", "measure")),
    # a looped placement: one group simulated job by job (symmetry.py), each rank's program
    # lowered when read (none here)
    ("fslpp", None, ("placement_table", "priorities", "simulate")),
])
def test_the_timers_see_every_phase(schedule: str, cap: str | None,
                                    expected: tuple[str, ...]) -> None:
    from lightning_gsched.schedule.plan import plan

    with phase_timers() as (times, calls):
        plan(schedule, 4, stages=8, microbatches=8, **({"cap": cap} if cap else {}))
    for label in expected:
        assert calls[label] >= 1, label
    assert set(times) == set(PHASES)
    timed = time_plan(schedule, 4, 8, 8, 1)
    assert timed["valid"] and timed["simulations"] >= 1


def test_the_scale_row_measures_plan_and_one_rank_in_a_fresh_process() -> None:
    """planner_scale_1024's measurement at a tiny W (seconds): its fields, the markdown, a
    timeout recorded as such, and the child's own peak (not the parent's: ru_maxrss of a child
    counts the spawning process's RSS, so a parent holding 192 MB must not show in the row)."""
    from benchmarks.bench_planner import measure_scale, scale_markdown

    held = bytearray(192 << 20)
    held[::4096] = b"\1" * len(held[::4096])  # touched: resident in this process
    rows = [measure_scale(name, W=8, timeout=60.0) for name in ("ddp", "1f1b")]
    for row in rows:
        assert row["passed"] and not row["timed_out"] and row["exit"] == 0, row
        assert row["jobs"] > 0 and row["rank_actions"] > 0 and row["S"] >= 1
        assert row["seconds"] == round(row["plan_s"] + row["rank_s"], 3)
        assert 0 < row["peak_mb"] < 150, row
    stopped = measure_scale("fsdp", W=8, timeout=0.0)
    assert stopped["timed_out"] and not stopped["passed"] and stopped["seconds"] is None
    table = scale_markdown([*rows, stopped]).splitlines()
    assert len(table) == 2 + 3 and table[2].startswith("| ddp | 1 | 8 | - | 16 |")
    assert table[-1].endswith("| no: timed out after 0 s |")
    del held
