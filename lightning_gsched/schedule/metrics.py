"""Metrics read off the programs (what moves, what is held) and the timeline (when). Counts come
from the programs, not the placement: the runtime executes the programs, and its counters must
equal these numbers exactly. One pass per rank (counting never waits on another rank, so it needs
no walker): a tally of ops and running sums, all in C loops.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from typing import Sequence

from lightning_gsched.schedule.counts import ActionCounts
from lightning_gsched.schedule.lazy_ranks import LazyList
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
    per_worker: Sequence[WorkerMetrics]  # a list, or a LazyList: each rank's when first read

    def max_of(self, field: str) -> float:
        """The largest of every worker's ``field``: a reader of every worker, so a lazy plan's
        are made at once (one full lowering, not W rank-local ones: ``gsched compare`` at
        W=256 took 83 s the other way)."""
        if isinstance(self.per_worker, LazyList):
            self.per_worker.make_all()
        values: list[float] = [getattr(m, field) for m in self.per_worker]  # int or float fields
        return max(values)


# the +1/-1 steps of a running sum, per op, built once: the stash (F, then the op that releases
# it) and the fetched stages resident
_STASH_STEPS = {release: {**dict.fromkeys(Op, 0), Op.F: 1, release: -1}
                for release in (Op.B, Op.W)}
_RESIDENT_STEPS = {**dict.fromkeys(Op, 0), Op.FETCH_W: 1, Op.FREE_W: -1}


def program_counts(programs: Programs, rank: int, into: ActionCounts | None = None) -> ActionCounts:
    """One rank's counts, filled into ``into`` (zeroed, e.g. a :class:`WorkerMetrics`). Each
    peak is the largest running sum of +1/-1 steps; a tie's actions move only ``tie_*``."""
    counts = ActionCounts() if into is None else into
    counts.owned_stages = counts.peak_resident_stages = len(programs.owned_stages(rank))
    release = programs.weight_grad_op  # None: forward-only, nothing stashed
    program = programs.ranks[rank]
    tie_tally: Counter[Op] = Counter()
    if programs.ties:  # a tie's actions are left out of the stages' counts and peaks
        tie_tally.update(a[0] for a in program if a[5])
        program = [a for a in program if not a[5]]
    ops = list(map(itemgetter(0), program))
    tally = Counter(ops)
    # a running sum that never moves peaks at 0 (``into``'s zero)
    if release is not None and tally[Op.F]:
        counts.peak_activations = max(accumulate(map(_STASH_STEPS[release].__getitem__, ops),
                                                 initial=0))
    if tally[Op.FETCH_W]:
        counts.peak_resident_stages += max(accumulate(map(_RESIDENT_STEPS.__getitem__, ops),
                                                      initial=0))
    for tie, ops_tally in ((False, tally), (True, tie_tally)):
        for op, n in ops_tally.items():
            name = OPS[op].counter_of(tie)
            if name is not None:
                setattr(counts, name, getattr(counts, name) + n)
    return counts


def measure(programs: Programs, timeline: Timeline, lazy: bool = False) -> PlanMetrics:
    """Latency and bubble from the timeline, each worker's counts from its program; ``lazy``: a
    worker's counts when first read, so a plan lowered per rank lowers nothing until then."""
    W, busy, latency = programs.world_size, timeline.busy, timeline.latency

    def worker(rank: int) -> WorkerMetrics:
        counts = WorkerMetrics(worker=rank, busy=busy[rank])
        program_counts(programs, rank, into=counts)
        return counts

    def every() -> list[WorkerMetrics]:  # a reader of every row: every program at once
        programs.ranks.make_all()
        return [worker(rank) for rank in range(W)]

    total_busy = 0.0
    for rank in range(W):
        total_busy += busy[rank]
    capacity = latency * W
    bubble = 1.0 - total_busy / capacity if capacity > 0 else 0.0
    per_worker = LazyList(W, worker, every) if lazy else every()
    return PlanMetrics(latency=latency, bubble_fraction=bubble, per_worker=per_worker)
