"""Metrics read off the programs (what moves, what is held) and the timeline (when).

Counts come from the programs, not from the placement, because the programs are what the runtime
executes: its counters must equal these numbers exactly. They are one
:class:`~lightning_gsched.schedule.counts.ActionCounts` per rank, read in one pass over each
rank's program with the op table's counters (counting never waits on another rank, so it needs
no walker).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from operator import itemgetter

from lightning_gsched.schedule.counts import ActionCounts
from lightning_gsched.schedule.program import OPS, Op, Programs
from lightning_gsched.schedule.simulate import Timeline


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


# op -> the ActionCounts field one such action adds 1 to (the op table's counters)
_COUNTER_OF = {op: spec.counter for op, spec in OPS.items() if spec.counter is not None}


def program_counts(programs: Programs, rank: int) -> ActionCounts:
    """Message counts, peak stash and peak residency of one rank's program.

    One pass: the message counters are a tally of ops (each op's counter in the op table), the
    peaks a running count raised at F / FETCH_W and lowered at the stash's release / FREE_W.
    """
    owned = len(programs.owned_stages(rank))
    release = programs.releases_stash  # None: forward-only, nothing stashed
    forward = Op.F if release is not None else None
    fetch, free = Op.FETCH_W, Op.FREE_W
    stash = peak_stash = 0
    resident = peak_resident = owned
    program = programs.ranks[rank]
    for action in program:
        op = action[0]
        if op is forward:
            stash += 1
            if stash > peak_stash:
                peak_stash = stash
        elif op is release:
            stash -= 1
        elif op is fetch:
            resident += 1
            if resident > peak_resident:
                peak_resident = resident
        elif op is free:
            resident -= 1
    counts = ActionCounts(owned_stages=owned, peak_resident_stages=peak_resident,
                          peak_activations=peak_stash)
    for op, n in Counter(map(itemgetter(0), program)).items():
        name = _COUNTER_OF.get(op)
        if name is not None:
            setattr(counts, name, getattr(counts, name) + n)
    return counts


def measure(programs: Programs, timeline: Timeline) -> PlanMetrics:
    latency = timeline.latency
    per_worker = []
    total_busy = 0.0
    for rank in range(programs.world_size):
        busy = sum([slot[3] - slot[2] for slot in timeline.by_worker[rank]])  # end - start
        total_busy += busy
        per_worker.append(WorkerMetrics(worker=rank, busy=busy,
                                        **program_counts(programs, rank).planned()))
    capacity = latency * programs.world_size
    bubble = 1.0 - total_busy / capacity if capacity > 0 else 0.0
    return PlanMetrics(latency=latency, bubble_fraction=bubble, per_worker=per_worker)
