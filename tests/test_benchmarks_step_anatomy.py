"""benchmarks/step_anatomy.py's arithmetic on recorded events (no timing here).

What a reader of its table relies on: a step's parts are cut where the calls were recorded,
the computations outside the schedule step are not counted, and "inside" is the time between
the first computation and the last that no computation covers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.step_anatomy import anatomy, parts_of, steps_of  # noqa: E402


def step_events(t0: float) -> list[tuple[str, float, float]]:
    """One recorded step starting at t0 (seconds): schedule 0-10, computations at 1-3 (F),
    4-8 (B), 8.5-9 (W), the optimizer 10.5-11; a computation outside the schedule step (the
    build's probe, say) at -2..-1 must not count."""
    return [("F", t0 - 2, t0 - 1),
            ("F", t0 + 1, t0 + 3), ("B", t0 + 4, t0 + 8), ("W", t0 + 8.5, t0 + 9),
            ("S", t0, t0 + 10), ("O", t0 + 10.5, t0 + 11)]


def test_a_step_is_cut_into_its_parts() -> None:
    (step,) = steps_of(step_events(0.0))
    parts = parts_of(step, loop_time=11.5)
    assert parts["step"] == [11.5]
    assert parts["before"] == [1.0] and parts["after"] == [1.0]
    assert parts["busy"] == [2.0 + 4.0 + 0.5]
    assert parts["inside"] == [pytest.approx(8.0 - 6.5)]  # 1..9 less the computations
    assert parts["optimizer"] == [0.5]
    assert parts["F"] == [2.0] and parts["B"] == [4.0] and parts["W"] == [0.5]


def test_steps_end_at_their_optimizer_step_and_warm_up_steps_are_dropped() -> None:
    events = step_events(0.0) + step_events(100.0) + [("F", 200.0, 201.0)]  # an unfinished step
    assert len(steps_of(events)) == 2
    out = {"events": step_events(0.0) + [(k, a + 100, b + 100) for k, a, b in
                                         step_events(0.0)[1:]],
           "times": [99.0, 11.5]}
    out["events"][2] = ("B", 4.0, 9.0)  # the first (warm-up) step's B is longer
    (rank,) = anatomy([[out]], warmup=1)
    assert rank["B"] == 4000.0 and rank["step"] == 11500.0  # ms, the second step's only
