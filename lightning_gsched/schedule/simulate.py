"""The seed's clock-free greedy simulation, ``argmin max(t(worker), t(job)) + eps * n`` among
ready jobs (every worker's earliest-startable job, ties broken by the order ``n``, the earliest
of those first), with a heap instead of a scan of the frontier: an event-ordered list scheduler,
O(log J) per job. A forward may not start on a worker holding ``cap`` stashes (forwards whose
backward has not finished; a reserving placement charges :func:`.reserve.stash_charges` instead
of 1). If no worker can start anything while jobs remain, :class:`CapTooSmallError` says who."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple, Sequence

from lightning_gsched.errors import CapTooSmallError, ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.jobs import Job, Phase, StageGraph, weight_grad_phase
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.priorities import inverse
from lightning_gsched.schedule.replicas import ReplicaLayout
from lightning_gsched.schedule.reserve import stash_charges


@dataclass(frozen=True)
class Costs:
    """Duration of each (stage, phase); ``weight``: W's when split. :meth:`build` halves the
    backward between B and W by default (for a layer's matmuls each costs about one forward)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...] = ()

    @classmethod
    def build(cls, stages: int, forward: float | Sequence[float] = 1.0,
              backward: float | Sequence[float] = 2.0,
              weight: float | Sequence[float] | None = None, split: bool = False) -> "Costs":
        fwd = cls._per_stage("forward", forward, stages)
        bwd = cls._per_stage("backward", backward, stages)
        if not split:
            if weight is not None:
                raise ScheduleConfigError(
                    "weight_cost is the duration of the W phase, which only schedules with a "
                    "split backward have (zb-h1, zb-h2, zbv, v-half, v-min, or "
                    "split_backward=True); drop weight_cost or choose such a schedule")
            return cls(fwd, bwd)
        if weight is None:
            halves = tuple(b / 2 for b in bwd)
            return cls(fwd, halves, halves)
        return cls(fwd, bwd, cls._per_stage("weight", weight, stages))

    def with_recompute(self, checkpointed: Sequence[bool]) -> "Costs":
        """These costs with each checkpointed stage's forward added to its B, which runs the
        forward again first (split: W reuses B's graph and costs what it did)."""
        backward = tuple(b + f if ckpt else b for b, f, ckpt
                         in zip(self.backward, self.forward, checkpointed, strict=True))
        return Costs(self.forward, backward, self.weight)

    @staticmethod
    def _per_stage(label: str, value: float | Sequence[float], stages: int) -> tuple[float, ...]:
        checked = validate.costs(f"{label}_cost", value, stages)
        return checked if isinstance(checked, tuple) else (checked,) * stages

    def of(self, job: Job) -> float:
        phase = job.phase
        if phase is Phase.F:
            return self.forward[job.stage]
        return self.backward[job.stage] if phase is Phase.B else self.weight[job.stage]

    def by_phase(self) -> dict[Phase, tuple[float, ...]]:
        """Durations per phase (W only when split)."""
        table = {Phase.F: self.forward, Phase.B: self.backward}
        if self.weight:
            table[Phase.W] = self.weight
        return table


class Slot(NamedTuple):
    """One job placed in time on its compute worker."""

    job: Job
    worker: int
    start: float
    end: float


class Timeline:
    """Every job's worker and start/end time, by flat job index ``i = (stage * micro + b) * P +
    k`` (k: the phase's place in ``phases``): ``start[i]``, ``end[i]``, ``order[w]`` (worker w's
    indices in order), ``sequence`` (placement order), ``busy[w]`` (the sum of w's ``end -
    start`` in order). :attr:`slots` and :attr:`by_worker` are built on first use only."""

    def __init__(self, workers: int, stages: int, micro: int, phases: tuple[Phase, ...],
                 order: Sequence[list[int]], start: Sequence[float], end: Sequence[float],
                 sequence: list[int] | Callable[[], list[int]], busy: list[float],
                 latency: float | None = None, replicas: ReplicaLayout | None = None) -> None:
        self.workers, self.stages, self.micro, self.phases = workers, stages, micro, phases
        # lists, or compact equivalents (sweep.py: ``array('d')`` times, lazy per-worker lists)
        self.order, self.start, self.end, self.busy = order, start, end, busy
        self._latency = latency  # else the largest end, when asked
        self._sequence = sequence  # a callable: built when first read
        # by group symmetry: replica g (b = g mod G) runs replica 0's order with b renamed
        self.replicas = replicas

    @property
    def sequence(self) -> list[int]:
        if callable(self._sequence):
            self._sequence = self._sequence()
        return self._sequence

    @property
    def latency(self) -> float:
        if self._latency is None:
            self._latency = max(self.end, default=0.0)
        return self._latency

    def job(self, index: int) -> Job:
        P = len(self.phases)
        stage, micro = divmod(index // P, self.micro)
        return Job(stage, micro, self.phases[index % P])

    def index(self, job: Job) -> int:
        """The flat index of ``job`` (the inverse of :meth:`job`)."""
        return (job.stage * self.micro + job.micro) * len(self.phases) + \
            self.phases.index(job.phase)

    @cached_property
    def _slots(self) -> tuple[list[Slot], list[list[Slot]]]:
        P, B, phases, start, end = len(self.phases), self.micro, self.phases, self.start, self.end
        new_tuple = tuple.__new__  # NamedTuples without their __new__ frame
        slot_of: dict[int, Slot] = {}
        for worker, indices in enumerate(self.order):
            for i in indices:
                q = i // P
                job = new_tuple(Job, (q // B, q % B, phases[i % P]))
                slot_of[i] = new_tuple(Slot, (job, worker, start[i], end[i]))
        return ([slot_of[i] for i in self.sequence],
                [[slot_of[i] for i in indices] for indices in self.order])

    @property
    def slots(self) -> list[Slot]:
        """Every job's slot, in the order the simulation placed them (start times ascending)."""
        return self._slots[0]

    @property
    def by_worker(self) -> list[list[Slot]]:
        """Per worker, its slots in the order it runs them."""
        return self._slots[1]


class _Worker:
    """One worker's queues per phase k: ``pending[k]`` heaps (ready time, rank) of jobs not yet
    startable, ``ready[k]`` heaps the ranks startable now. Ranks, not jobs, so every heap
    comparison is of floats and ints."""

    __slots__ = ("free_at", "stash", "cap", "pending", "ready", "version", "phases", "next_start")

    def __init__(self, cap: int | None, phases: int) -> None:
        self.free_at, self.stash, self.cap, self.version = 0.0, 0, cap, 0
        self.phases = range(phases)  # 0 F, 1 B, 2 W
        self.pending: list[list[tuple[float, int]]] = [[] for _ in self.phases]
        self.ready: list[list[int]] = [[] for _ in self.phases]
        self.next_start: float | None = None  # start of its valid event (None: no event)

    def forward_allowed(self, charge: int) -> bool:
        return self.cap is None or self.stash + charge <= self.cap

    # reserving placements only: a forward's charge depends on the job, so a later one, already
    # paid for, may start while the heap's head is refused
    def best_forward(self, charges: list[int], job_of: list[int], phases: int) -> int:
        """The smallest-ranked ready forward the cap allows, or -1."""
        return min((rank for rank in self.ready[0]
                    if self.forward_allowed(charges[job_of[rank] // phases])), default=-1)

    def next_forward(self, charges: list[int], job_of: list[int],
                     phases: int) -> tuple[float, int] | None:
        """The earliest (ready time, rank) of a pending forward the cap allows, or None."""
        return min((entry for entry in self.pending[0]
                    if self.forward_allowed(charges[job_of[entry[1]] // phases])), default=None)

    def take_forward(self, rank: int) -> None:
        """Remove the forward ``rank`` from its queue, wherever in the heap it is."""
        if rank in self.ready[0]:
            self.ready[0].remove(rank)
            heapq.heapify(self.ready[0])
            return
        pending = self.pending[0]
        pending.remove(next(entry for entry in pending if entry[1] == rank))
        heapq.heapify(pending)


_PHASE_INDEX = {Phase.F: 0, Phase.B: 1, Phase.W: 2}


def simulate(graph: StageGraph, table: PlacementTable, ranks: Sequence[int], costs: Costs,
             caps: Sequence[int | None]) -> Timeline:
    """Run the greedy schedule to completion: a hot loop with the plain rule's results
    (tests/planner_references.py). An event carries its worker's choice and version, so a valid
    event is taken without choosing again and a stale one skipped; a worker starting something
    now is not refreshed for a job ready only later; a single-predecessor successor is ready
    when its job ends. A stash counts from its F until its last backward phase."""
    W, S, B = table.workers, table.stages, table.micro
    P = len(graph.phases)
    total = P * S * B
    workers = [_Worker(caps[w], P) for w in range(W)]
    compute = table.compute
    duration = [costs.by_phase()[d] for d in graph.phases]
    release = _PHASE_INDEX[weight_grad_phase(graph.split_backward)]
    heappush, heappop = heapq.heappush, heapq.heappop
    events: list[tuple[float, int, int, int, int]] = []  # (start, rank, worker, version, phase)
    job_of = inverse(list(ranks))  # rank -> flat job index
    charges = stash_charges(table.compute) if table.reserves_stash else None

    def refresh(w: int) -> None:
        """Push worker w's next job as its (new) valid event: startable now (at ``free_at``)
        beats startable later, then the smaller rank; a forward only while the cap allows it."""
        state = workers[w]
        state.version += 1
        free_at = state.free_at
        pending, ready = state.pending, state.ready
        forward = state.cap is None or state.stash < state.cap
        now_rank = -1
        now_k = 0
        for k in state.phases:
            pend, queue = pending[k], ready[k]
            while pend and pend[0][0] <= free_at:
                heappush(queue, heappop(pend)[1])
            if not k and charges is not None:  # k = 0 comes first: now_rank is still -1
                now_rank = state.best_forward(charges, job_of, P)
                continue
            if queue and (k or forward) and (now_rank < 0 or queue[0] < now_rank):
                now_rank, now_k = queue[0], k
        if now_rank >= 0:
            heappush(events, (free_at, now_rank, w, state.version, now_k))
            state.next_start = free_at
            return
        later: tuple[float, int, int] | None = None
        for k in state.phases:
            pend = pending[k]
            if not k and charges is not None:
                entry = state.next_forward(charges, job_of, P)
                if entry is not None:
                    later = (entry[0], entry[1], 0)
                continue
            if pend and (k or forward):
                cand = (pend[0][0], pend[0][1], k)
                if later is None or cand < later:
                    later = cand
        if later is not None:
            heappush(events, (later[0], later[1], w, state.version, later[2]))
            state.next_start = later[0]
        else:
            state.next_start = None

    # pred/succ depend on the microbatch only through b itself: tabulate them per (stage, phase),
    # successors with their flat index at b = 0 and whether they have a single predecessor
    n_pred = {(s, d): len(graph.pred(Job(s, 0, d))) for s in range(S) for d in graph.phases}
    successors = [  # by stage * P + phase index
        [(j.stage, _PHASE_INDEX[j.phase], j.stage * B * P + _PHASE_INDEX[j.phase],
          n_pred[(j.stage, j.phase)] == 1)
         for j in graph.succ(Job(s, 0, d))]
        for s in range(S) for d in graph.phases
    ]
    missing: list[int] = []
    for s in range(S):
        missing.extend([n_pred[(s, d)] for d in graph.phases] * B)
    ready_time = [0.0] * total
    touched: list[int] = []
    for (s, d), count in n_pred.items():
        if count == 0:  # sources: ready at time 0
            k = _PHASE_INDEX[d]
            for b in range(B):
                w = compute[s][b]
                heappush(workers[w].pending[k], (0.0, ranks[(s * B + b) * P + k]))
                touched.append(w)
    for w in dict.fromkeys(touched):
        refresh(w)

    start_of, end_of = [0.0] * total, [0.0] * total  # by flat job index
    order: list[list[int]] = [[] for _ in range(W)]  # per worker, its flat jobs in order
    append_to = [jobs.append for jobs in order]
    busy = [0.0] * W  # per worker, the sum of its jobs' end - start, in its order
    sequence: list[int] = []  # flat jobs in the order they are placed
    place = sequence.append
    BP = B * P
    while events:
        start, rank, w, version, k = heappop(events)
        state = workers[w]
        if version != state.version:
            continue
        ready = state.ready[k]  # a valid event: take its job
        if ready and ready[0] == rank:
            heappop(ready)
        elif not k and charges is not None:
            state.take_forward(rank)
        else:
            heappop(state.pending[k])
        i = job_of[rank]
        stage = i // BP
        micro = (i - stage * BP) // P
        end = start + duration[k][stage]
        if k == 0:
            state.stash += 1 if charges is None else charges[i // P]
        elif k == release:
            state.stash -= 1
        start_of[i] = start
        end_of[i] = end
        busy[w] += end - start
        append_to[w](i)
        place(i)
        state.free_at = end
        for nstage, nk, offset, single in successors[stage * P + k]:
            n = offset + micro * P
            if single:
                at = end
            else:
                left = missing[n] - 1
                missing[n] = left
                at = ready_time[n]
                if end > at:
                    at = ready_time[n] = end
                if left:
                    continue
            nw = compute[nstage][micro]
            other = workers[nw]
            if at <= other.free_at:  # startable when it frees: refresh would move it there
                heappush(other.ready[nk], ranks[n])
            else:
                heappush(other.pending[nk], (at, ranks[n]))
            # another worker's event stands when it starts something now and the new job is
            # ready only later ("startable now" beats it whatever its rank)
            if nw != w and not (other.next_start == other.free_at and at > other.free_at):
                refresh(nw)
        refresh(w)

    if len(sequence) == total:
        return Timeline(W, S, B, graph.phases, order, start_of, end_of, sequence, busy)
    blocked = []  # the workers whose every waiting forward the cap refuses
    for w, state in enumerate(workers):
        waiting = [job_of[rank] for _, rank in state.pending[0]] + [
            job_of[rank] for rank in state.ready[0]]
        if waiting and not any(state.forward_allowed(1 if charges is None else charges[i // P])
                               for i in waiting):
            stage, b = divmod(min(waiting) // P, B)  # F jobs: flat order is (stage, micro)
            assert state.cap is not None  # forward_allowed() is False only under a cap
            blocked.append((w, state.stash, state.cap, Job(stage, b, graph.phases[0])))
    raise stuck_error(blocked, len(sequence), total, caps)


def stuck_error(blocked: Sequence[tuple[int, int, int, Job]], placed: int, total: int,
                caps: Sequence[int | None]) -> CapTooSmallError:
    """``blocked``: (worker, stash, cap, its first waiting forward). Shared with the sweep."""
    detail = "; ".join(
        f"worker {w} holds {stash} activations (cap {cap}) and cannot start {job}"
        for w, stash, cap, job in blocked) or "no worker has a startable job"
    return CapTooSmallError(
        f"the schedule cannot make progress after {placed} of {total} jobs: {detail}. The "
        f"activation cap {list(caps)} is too small for this placement and order; raise the cap, "
        "use cap='auto' (the smallest cap that keeps the uncapped latency) or cap=None")
