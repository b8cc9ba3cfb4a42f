"""The engine's row exchange reads which microbatches each rank needs from the placement
table (``engine.step_rows.needed_micros``), not from every rank's program: the same answer as the
programs give (``runtime.stage_micros``), for every library schedule, training and
forward-only, checked here against the programs themselves."""

from __future__ import annotations

import pytest

from lightning_gsched.engine.step_rows import needed_micros
from lightning_gsched.runtime import stage_micros
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.plan import plan


@pytest.mark.parametrize("schedule", sorted(LIBRARY))
@pytest.mark.parametrize("forward_only", [False, True])
def test_table_gives_what_the_programs_give(schedule: str, forward_only: bool) -> None:
    W = 4
    S = 8 if schedule in ("zbv", "v-half", "v-min", "interleaved", "lpp") else 4
    p = plan(schedule, W, stages=S, microbatches=8, forward_only=forward_only)
    from_programs = []
    for r in range(W):
        first, last = stage_micros(p.programs, r)
        from_programs.append(sorted(set(first) | set(last)))
    assert needed_micros(p.table.compute, W) == from_programs
