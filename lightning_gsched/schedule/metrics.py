"""Metrics read off the programs (what moves, what is held) and the timeline (when).

Counts come from the programs, not from the placement, because the programs are what the runtime
executes: its counters must equal these numbers exactly. They are one
:class:`~lightning_gsched.schedule.counts.ActionCounts` per rank, read in one pass over each
rank's program with the op table's counters (counting never waits on another rank, so it needs
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
        values: list[float] = [getattr(m, field) for m in self.per_worker]  # int or float fields
        return max(values)


# op -> the ActionCounts field one such action adds 1 to (the op table's counters), of a stage
# and of a tie (``Action.tie``)
_COUNTER_OF = {op: spec.counter for op, spec in OPS.items() if spec.counter is not None}
_TIE_COUNTER_OF = {op: spec.tie_counter for op, spec in OPS.items()
                   if spec.tie_counter is not None}


def _steps(up: Op, down: Op) -> dict[Op, int]:
    """+1 for ``up``, -1 for ``down``, 0 for every other op: the step of a running sum."""
    step = dict.fromkeys(Op, 0)
    step[up], step[down] = 1, -1
    return step


# built once, not per rank: at W = 10^5 building them per call cost seconds
_STASH_STEPS = {release: _steps(Op.F, release) for release in (Op.B, Op.W)}
_RESIDENT_STEPS = _steps(Op.FETCH_W, Op.FREE_W)


def program_counts(programs: Programs, rank: int, into: ActionCounts | None = None
                   ) -> ActionCounts:
    """Message counts, peak stash and peak residency of one rank's program.

    The message counters are a tally of ops (each op's counter in the op table); each peak is
    the largest running sum of +1/-1 steps: F and the op that releases the stash (B, or W when
    the backward is split) for activations, FETCH_W and FREE_W of a stage (not of a tie) for
    resident stages. A tie's actions move the ``tie_*`` counters (:attr:`OpSpec.tie_counter`).
    ``into``: the (zeroed) counts to fill, e.g. a :class:`WorkerMetrics`.
    """
    owned = len(programs.owned_stages(rank))
    release = programs.weight_grad_op  # None: forward-only, nothing stashed
    program = programs.ranks[rank]
    tie_tally: Counter[Op] = Counter()
    if programs.ties:  # a tie's actions are left out of the stages' counts and peaks
        tie_tally.update(a[0] for a in program if a[5])
        program = [a for a in program if not a[5]]
    ops = list(map(itemgetter(0), program))
    tally = Counter(ops)
    peak_activations = peak_fetched = 0  # a running sum that never moves peaks at 0
    if release is not None and tally[Op.F]:
        peak_activations = max(accumulate(map(_STASH_STEPS[release].__getitem__, ops),
                                          initial=0))
    if tally[Op.FETCH_W]:
        peak_fetched = max(accumulate(map(_RESIDENT_STEPS.__getitem__, ops), initial=0))
    counts = ActionCounts() if into is None else into
    counts.owned_stages = owned
    counts.peak_activations = peak_activations
    counts.peak_resident_stages = owned + peak_fetched
    for counter_of, ops_tally in ((_COUNTER_OF, tally), (_TIE_COUNTER_OF, tie_tally)):
        for op, n in ops_tally.items():
            name = counter_of.get(op)
            if name is not None:
                setattr(counts, name, getattr(counts, name) + n)
    return counts


def measure_lazily(programs: Programs, timeline: Timeline) -> PlanMetrics:
    """:func:`measure`, each worker's counts read off its program when first asked for.

    Latency and bubble come from the timeline at once; a plan whose programs are lowered per
    rank on demand (:mod:`.lazy_ranks`) then lowers nothing until a worker's row is read.
    """
    busy = timeline.busy

    def worker(rank: int) -> WorkerMetrics:
        counts = WorkerMetrics(worker=rank, busy=busy[rank])
        program_counts(programs, rank, into=counts)
        return counts

    latency = timeline.latency
    capacity = latency * programs.world_size
    total_busy = 0.0
    for rank in range(programs.world_size):  # the same sum, in the same order, as measure()
        total_busy += busy[rank]
    bubble = 1.0 - total_busy / capacity if capacity > 0 else 0.0
    def every() -> list[WorkerMetrics]:  # a reader of every row: every program at once
        programs.ranks.make_all()
        return [worker(rank) for rank in range(programs.world_size)]

    return PlanMetrics(latency=latency, bubble_fraction=bubble,
                       per_worker=LazyList(programs.world_size, worker, every))


def measure(programs: Programs, timeline: Timeline) -> PlanMetrics:
    latency = timeline.latency
    per_worker = []
    total_busy = 0.0
    for rank in range(programs.world_size):
        busy = timeline.busy[rank]
        total_busy += busy
        worker = WorkerMetrics(worker=rank, busy=busy)
        program_counts(programs, rank, into=worker)  # filled in place
        per_worker.append(worker)
    capacity = latency * programs.world_size
    bubble = 1.0 - total_busy / capacity if capacity > 0 else 0.0
    return PlanMetrics(latency=latency, bubble_fraction=bubble, per_worker=per_worker)
