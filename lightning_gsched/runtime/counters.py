"""What one rank actually did in one step, counted as it happened: the planner's
:class:`~lightning_gsched.schedule.counts.ActionCounts` plus what the planner does not model, so
that ``counters.planned()`` equal to the plan's per-worker metrics shows the runtime executed
exactly the planned communication and held exactly the planned memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lightning_gsched.schedule.counts import PLANNED, ActionCounts


@dataclass
class RuntimeCounters(ActionCounts):
    """Counters of one step on one rank. Message counts move when the send is issued or the
    receive is posted. ``peak_activations``: the most (stage, microbatch) pairs stashed (forward
    done, last backward phase pending); ``peak_resident_stages``: owned stages plus fetched ones,
    raised when a fetch is posted and lowered when freed, as the planner counts."""

    # measured, not planned; bytes of point-to-point messages include headers
    bytes_sent: int = 0
    bytes_received: int = 0
    allreduce_bytes: int = 0  # stage and tie all-reduces (ALLREDUCE_G)
    stats_allreduces: int = 0  # end-of-step all-reduce of running statistics (BatchNorm)
    stats_allreduce_bytes: int = 0
    peak_resident_param_bytes: int = 0  # stage and tie buffers (owned + fetched)

    PLANNED: ClassVar[tuple[str, ...]] = PLANNED
