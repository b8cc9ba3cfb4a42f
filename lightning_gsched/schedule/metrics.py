"""Metrics read off the programs (what moves, what is held) and the timeline (when).

Counts come from the programs, not from the placement, because the programs are what the runtime
executes: its counters must equal these numbers exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_gsched.schedule.program import Op, Programs
from lightning_gsched.schedule.simulate import Timeline


@dataclass(frozen=True)
class WorkerMetrics:
    worker: int
    busy: float
    activation_recvs: int
    activation_sends: int
    input_grad_recvs: int
    input_grad_sends: int
    weight_fetches: int
    weight_serves: int
    grad_sends: int  # REDUCE_G: gradients of fetched stages sent to their owner
    grad_recvs: int
    allreduces: int
    peak_activations: int
    owned_stages: int
    peak_resident_stages: int

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


@dataclass(frozen=True)
class PlanMetrics:
    latency: float
    bubble_fraction: float
    per_worker: list[WorkerMetrics]

    def max_of(self, field: str) -> float:
        values: list[float] = [getattr(m, field) for m in self.per_worker]  # int or float fields
        return max(values)


def program_counts(programs: Programs, rank: int) -> dict[str, int]:
    """Message counts, peak stash and peak residency of one rank's program."""
    counts = {op: 0 for op in Op}
    stash = peak_stash = 0
    owned = len(programs.owned_stages(rank))
    resident = peak_resident = owned
    stashes = not programs.forward_only  # forward-only: nothing stashed
    F, B, FETCH_W, FREE_W = Op.F, Op.B, Op.FETCH_W, Op.FREE_W
    for action in programs.ranks[rank]:
        op = action.op
        counts[op] += 1
        if op is F:
            if stashes:
                stash += 1
                if stash > peak_stash:
                    peak_stash = stash
        elif op is B:
            stash -= 1
        elif op is FETCH_W:
            resident += 1
            if resident > peak_resident:
                peak_resident = resident
        elif op is FREE_W:
            resident -= 1
    return {
        "activation_recvs": counts[Op.RECV_ACT],
        "activation_sends": counts[Op.SEND_ACT],
        "input_grad_recvs": counts[Op.RECV_GRAD],
        "input_grad_sends": counts[Op.SEND_GRAD],
        "weight_fetches": counts[Op.FETCH_W],
        "weight_serves": counts[Op.SEND_W],
        "grad_sends": counts[Op.REDUCE_G],
        "grad_recvs": counts[Op.RECV_G],
        "allreduces": counts[Op.ALLREDUCE_G],
        "peak_activations": peak_stash,
        "owned_stages": owned,
        "peak_resident_stages": peak_resident,
    }


def measure(programs: Programs, timeline: Timeline) -> PlanMetrics:
    latency = timeline.latency
    per_worker = []
    total_busy = 0.0
    for rank in range(programs.world_size):
        busy = sum(slot.end - slot.start for slot in timeline.by_worker[rank])
        total_busy += busy
        per_worker.append(WorkerMetrics(worker=rank, busy=busy, **program_counts(programs, rank)))
    capacity = latency * programs.world_size
    bubble = 1.0 - total_busy / capacity if capacity > 0 else 0.0
    return PlanMetrics(latency=latency, bubble_fraction=bubble, per_worker=per_worker)
