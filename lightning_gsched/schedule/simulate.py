"""The seed's clock-free greedy simulation, with a heap instead of a scan of the frontier.

The seed picks, among jobs whose predecessors are done, the one whose successor can start
soonest: ``argmin max(t(worker), t(job)) + eps * n``. Equivalently: every worker's best candidate
is its earliest-startable ready job (ties broken by the order ``n``); the globally earliest of
those candidates runs next. Start times handed out this way never decrease, so the simulation is
an event-ordered list scheduler and each job costs O(log J): W=64, S=64, B=256 (32k jobs) takes
a fraction of a second.

Activation caps: a forward may not start on a worker that already holds ``cap`` activations
(forwards whose backward has not finished). If no worker can start anything while jobs remain,
the cap is too small and :class:`CapTooSmallError` says which worker is stuck and why. Where the
placement reserves stashes (:mod:`.reserve`), a forward is charged what :func:`.reserve.
stash_charges` says (a microbatch's first forward on a worker: all its stashes there; its later
forwards: nothing) and may start while the count plus its charge stays within the cap.

A forward-only graph (:class:`StageGraph` with ``forward_only=True``) simulates F jobs only; the
planner passes no caps then (nothing is stashed for a backward).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
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
    """Duration of each (stage, phase). Defaults follow the usual backward = 2 x forward.

    ``weight`` is the W phase's duration when the backward is split (zero-bubble schedules);
    then ``backward`` is the input-gradient part only. :meth:`build` with ``weight=None`` and
    ``split=True`` halves the given backward between B and W: for the matmuls that dominate a
    layer, the input gradient and the weight gradient each cost about one forward.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...] = ()

    @classmethod
    def build(
        cls, stages: int, forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] = 2.0, weight: float | Sequence[float] | None = None,
        split: bool = False,
    ) -> "Costs":
        fwd = cls._per_stage("forward", forward, stages)
        bwd = cls._per_stage("backward", backward, stages)
        if not split:
            if weight is not None:
                raise ScheduleConfigError(
                    "weight_cost is the duration of the W phase, which only schedules with a "
                    "split backward have (zb-h1, zb-h2, zbv, v-half, v-min, or "
                    "split_backward=True); drop "
                    "weight_cost or choose such a schedule"
                )
            return cls(fwd, bwd)
        if weight is None:
            halves = tuple(b / 2 for b in bwd)
            return cls(fwd, halves, halves)
        return cls(fwd, bwd, cls._per_stage("weight", weight, stages))

    def with_recompute(self, checkpointed: Sequence[bool]) -> "Costs":
        """These costs with each checkpointed stage's forward charged to its backward.

        Activation checkpointing: ``F s b`` of such a stage keeps only its inputs and ``B s b``
        runs the stage's forward again before its backward, so B costs B + F. When the backward
        is split, the recompute belongs to B (the input-gradient part, which needs the graph
        first); W reuses B's graph and costs what it did.
        """
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
    """One job placed in time on its compute worker (the public view of a :class:`Timeline`)."""

    job: Job
    worker: int
    start: float
    end: float


class Timeline:
    """Result of a simulation: every job with its worker and start/end time.

    The simulator records it densely, by flat job index ``i = (stage * micro + b) * P + k``
    (P = ``len(phases)``, k the phase's place in ``phases``): ``start[i]`` and ``end[i]``,
    ``order[w]`` (the flat indices worker w runs, in order), ``sequence`` (every flat index
    in the order the simulation placed it) and ``busy[w]`` (the sum of worker w's
    ``end - start``, in its order). The planner's own readers (lowering, metrics) read
    these lists; :attr:`slots` and :attr:`by_worker` (one :class:`Slot` per job) are built on
    first use, so a plan that nobody draws or prints never allocates its 10^5 Slots and Jobs.
    """

    def __init__(self, workers: int, stages: int, micro: int, phases: tuple[Phase, ...],
                 order: Sequence[list[int]], start: Sequence[float], end: Sequence[float],
                 sequence: list[int] | Callable[[], list[int]], busy: list[float],
                 latency: float | None = None) -> None:
        self.workers, self.stages, self.micro, self.phases = workers, stages, micro, phases
        # lists, or compact equivalents for 10^7 jobs (sweep.py: ``array('d')`` times and
        # per-worker lists made when read)
        self.order, self.start, self.end = order, start, end
        self._latency = latency  # known to the sweep; else the largest end, when asked
        # a callable: built when first read (a timeline by symmetry merges its groups' orders
        # only for a reader of every slot, see symmetry.py)
        self._sequence = sequence
        # set when built by group symmetry (symmetry.py): replica g (layout.members(g)) runs
        # microbatches b = g mod G, and the order of position p in replica g is position p's
        # in replica 0 with b renamed (same stages, same times); None: no such promise
        self.replicas: ReplicaLayout | None = None
        self.busy = busy
        self._slots: list[Slot] | None = None
        self._by_worker: list[list[Slot]] | None = None

    @property
    def sequence(self) -> list[int]:
        """Every flat job index in the order the simulation placed it."""
        if callable(self._sequence):
            self._sequence = self._sequence()
        return self._sequence

    @property
    def latency(self) -> float:
        if self._latency is None:
            self._latency = max(self.end, default=0.0)
        return self._latency

    def job(self, index: int) -> Job:
        """The job at flat index ``index``."""
        P = len(self.phases)
        stage, micro = divmod(index // P, self.micro)
        return Job(stage, micro, self.phases[index % P])

    def _build_slots(self) -> None:
        P, B, phases = len(self.phases), self.micro, self.phases
        start, end = self.start, self.end
        new_tuple = tuple.__new__  # NamedTuples without their __new__ frame
        slot_of: dict[int, Slot] = {}
        for worker, indices in enumerate(self.order):
            for i in indices:
                q = i // P
                job = new_tuple(Job, (q // B, q % B, phases[i % P]))
                slot_of[i] = new_tuple(Slot, (job, worker, start[i], end[i]))
        self._by_worker = [[slot_of[i] for i in indices] for indices in self.order]
        self._slots = [slot_of[i] for i in self.sequence]

    @property
    def slots(self) -> list[Slot]:
        """Every job's slot, in the order the simulation placed them (start times ascending)."""
        if self._slots is None:
            self._build_slots()
        assert self._slots is not None
        return self._slots

    @property
    def by_worker(self) -> list[list[Slot]]:
        """Per worker, its slots in the order it runs them."""
        if self._by_worker is None:
            self._build_slots()
        assert self._by_worker is not None
        return self._by_worker


class _Worker:
    """Ready queues of one worker per phase: jobs not yet startable by time, and startable now.

    Queues hold ranks (unique ints, the order's dense keys), not jobs: ``pending[k]`` heaps of
    (ready time, rank) and ``ready[k]`` heaps of ranks, so every heap comparison is of floats
    and ints; the simulator maps a rank back to its flat job index once, when the job runs.
    """

    __slots__ = ("free_at", "stash", "cap", "pending", "ready", "version", "phases", "next_start")

    def __init__(self, cap: int | None, phases: int) -> None:
        self.free_at = 0.0
        self.stash = 0
        self.cap = cap
        self.phases = range(phases)
        # index = phase (0 F, 1 B, 2 W)
        self.pending: list[list[tuple[float, int]]] = [[] for _ in self.phases]
        self.ready: list[list[int]] = [[] for _ in self.phases]
        self.version = 0
        self.next_start: float | None = None  # start of its valid event (None: no event)

    def forward_allowed(self, charge: int = 1) -> bool:
        return self.cap is None or self.stash + charge <= self.cap

    def best_forward(self, charges: list[int], job_of: list[int], phases: int) -> int:
        """The smallest-ranked ready forward the cap allows, or -1 (reserving placements only:
        there a forward's charge depends on the job, so the heap's head may be refused while a
        later forward, already paid for, may start)."""
        allowed = [rank for rank in self.ready[0]
                   if self.forward_allowed(charges[job_of[rank] // phases])]
        return min(allowed, default=-1)

    def next_forward(self, charges: list[int], job_of: list[int],
                     phases: int) -> tuple[float, int] | None:
        """The earliest (ready time, rank) of a pending forward the cap allows, or None."""
        allowed = [entry for entry in self.pending[0]
                   if self.forward_allowed(charges[job_of[entry[1]] // phases])]
        return min(allowed, default=None)

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


def simulate(
    graph: StageGraph,
    table: PlacementTable,
    ranks: Sequence[int],
    costs: Costs,
    caps: Sequence[int | None],
) -> Timeline:
    """Run the greedy schedule to completion and return the timeline.

    ``ranks``: :func:`~.priorities.priority_ranks`' dense keys, a permutation of the flat job
    indices ``(stage * B + micro) * P + phase`` (P phases per job: 1, 2 or 3), the layout this
    loop works in. Hot loop (``auto_cap`` runs it several times per plan), written for speed
    with the same results as the plain rule (tests/planner_references.py):

    - the queues hold ranks (ints), mapped back to the flat job once it runs;
    - an event carries the phase its worker's choice had when it was pushed, so a valid event
      (its worker unchanged since: same version) is taken without choosing again;
    - a worker whose event cannot change is not refreshed: it starts something now (at its
      ``free_at``) and the new job is only ready later; a stale event left by a refresh is
      skipped by its version (the heap's order depends only on the keys);
    - a successor with a single predecessor (every job of a chain) is ready when the job ends;
      one ready by its worker's ``free_at`` goes straight to the ready heap, where the next
      refresh would have moved it;
    - the timeline is recorded densely (:class:`Timeline`): no Slot or Job is built here.

    The stash of a (stage, microbatch) counts against the cap from its F until its last
    backward phase: B, or W when the graph splits the backward. A reserving placement
    (:mod:`.reserve`) charges a microbatch's stashes on a worker at its first forward there;
    only then does the forward queue need more than its head (:meth:`_Worker.best_forward`).
    """
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
        """Push worker w's next job under the greedy rule as its (new) valid event.

        Startable now (ready at ``free_at``) beats startable later; among those, the smaller
        rank wins (ranks are unique); a forward only while the cap allows it.
        """
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
    # successors with the index offset (stage * B * P + phase) of their flat slot.
    # A successor with a single predecessor (every job of a chain) is ready when this job ends:
    # its count and ready time need no bookkeeping.
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

    start_of = [0.0] * total  # by flat job index
    end_of = [0.0] * total
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
        # the worker is unchanged since this event was pushed: best() would return
        # (start, rank, k) again, so take that job directly
        ready = state.ready[k]
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
            # Another worker's event stands when it starts something now (at its free_at) and
            # the new job is only ready later: "startable now" beats it whatever its rank, so
            # the greedy choice would be the same event (and it is taken from ``ready``).
            # (Refreshing it now rather than after the other successors gives the same valid
            # event: a stale one left behind is skipped by its version.)
            if nw != w and not (other.next_start == other.free_at and at > other.free_at):
                refresh(nw)
        refresh(w)

    if len(sequence) != total:
        raise _stuck_error(workers, job_of, graph.phases, B, len(sequence), total, caps,
                           charges)
    return Timeline(W, S, B, graph.phases, order, start_of, end_of, sequence, busy)


def _stuck_error(
    workers: list[_Worker], job_of: list[int], phases: tuple[Phase, ...], micro: int,
    placed: int, total: int, caps: Sequence[int | None], charges: list[int] | None = None,
) -> CapTooSmallError:
    blocked = []
    P = len(phases)
    for w, state in enumerate(workers):
        waiting = [job_of[rank] for _, rank in state.pending[0]] + [
            job_of[rank] for rank in state.ready[0]]
        if waiting and not any(state.forward_allowed(1 if charges is None else charges[i // P])
                               for i in waiting):
            stage, b = divmod(min(waiting) // P, micro)  # F jobs: flat order is (stage, micro)
            assert state.cap is not None  # forward_allowed() is False only under a cap
            blocked.append((w, state.stash, state.cap, Job(stage, b, phases[0])))
    return stuck_error(blocked, placed, total, caps)


def stuck_error(blocked: Sequence[tuple[int, int, int, Job]], placed: int, total: int,
                caps: Sequence[int | None]) -> CapTooSmallError:
    """The error when no worker can start anything: per blocked worker (worker, stash, cap, its
    first waiting forward). Shared with the sweep (sweep.py), which must fail the same way."""
    detail = "; ".join(
        f"worker {w} holds {stash} activations (cap {cap}) and cannot start {job}"
        for w, stash, cap, job in blocked) or "no worker has a startable job"
    return CapTooSmallError(
        f"the schedule cannot make progress after {placed} of {total} jobs: {detail}. The "
        f"activation cap {list(caps)} is too small for this placement and order; raise the cap, "
        "use cap='auto' (the smallest cap that keeps the uncapped latency) or cap=None"
    )
