"""Metrics read off the programs (what moves, what is held) and the timeline (when).

Counts come from the programs, not from the placement, because the programs are what the runtime
executes: its counters must equal these numbers exactly. They are one
:class:`~lightning_gsched.schedule.counts.ActionCounts` per rank, filled by a handler of the
program walker (:mod:`.walk`) with the op table's counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_gsched.schedule.counts import ActionCounts
from lightning_gsched.schedule.program import Action, Op, Programs
from lightning_gsched.schedule.simulate import Timeline
from lightning_gsched.schedule.walk import walk_rank


@dataclass
class WorkerMetrics(ActionCounts):
    """One worker's :class:`ActionCounts` plus its busy time in the simulated timeline."""

    worker: int = 0
    busy: float = 0.0


@dataclass(frozen=True)
class PlanMetrics:
    latency: float
    bubble_fraction: float
    per_worker: list[WorkerMetrics]

    def max_of(self, field: str) -> float:
        values: list[float] = [getattr(m, field) for m in self.per_worker]  # int or float fields
        return max(values)


class _Counter:
    """Walk handler: message counters from the op table, peak stash and peak residency."""

    def __init__(self, programs: Programs, rank: int) -> None:
        owned = len(programs.owned_stages(rank))
        self.counts = ActionCounts(owned_stages=owned, peak_resident_stages=owned)
        self.release = programs.releases_stash  # None: forward-only, nothing stashed
        self.stash = 0
        self.resident = owned

    def compute(self, rank: int, action: Action) -> None:
        if self.release is None:
            return
        if action.op is Op.F:
            self.stash += 1
            self.counts.peak_activations = max(self.counts.peak_activations, self.stash)
        elif action.op is self.release:
            self.stash -= 1

    def send(self, rank: int, action: Action) -> None:
        self.counts.count(action.op)

    def recv(self, rank: int, action: Action) -> None:
        self.counts.count(action.op)
        if action.op is Op.FETCH_W:
            self.resident += 1
            self.counts.peak_resident_stages = max(self.counts.peak_resident_stages, self.resident)

    def free(self, rank: int, action: Action) -> None:
        self.resident -= 1

    def collective(self, rank: int, action: Action) -> None:
        self.counts.count(action.op)


def program_counts(programs: Programs, rank: int) -> ActionCounts:
    """Message counts, peak stash and peak residency of one rank's program."""
    handler = _Counter(programs, rank)
    walk_rank(programs, rank, handler)
    return handler.counts


def measure(programs: Programs, timeline: Timeline) -> PlanMetrics:
    latency = timeline.latency
    per_worker = []
    total_busy = 0.0
    for rank in range(programs.world_size):
        busy = sum(slot.end - slot.start for slot in timeline.by_worker[rank])
        total_busy += busy
        per_worker.append(WorkerMetrics(worker=rank, busy=busy,
                                        **program_counts(programs, rank).planned()))
    capacity = latency * programs.world_size
    bubble = 1.0 - total_busy / capacity if capacity > 0 else 0.0
    return PlanMetrics(latency=latency, bubble_fraction=bubble, per_worker=per_worker)
