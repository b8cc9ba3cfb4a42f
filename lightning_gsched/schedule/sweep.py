"""The greedy simulation of a pipeline, swept in time windows over per-stage queues (numpy): the
very timeline of :func:`.simulate.simulate` (microseconds per job, millions at W=1024) for a few
numpy operations per window (about latency / shortest job). It applies (:func:`sweepable`) to a
chain whose every stage runs on one compute worker for all microbatches (looped placements go to
:mod:`.symmetry`) under an order whose keys increase with ``b`` for every (stage, phase).

**Why it is the simulator's timeline, exactly.**

1. *Queues.* The jobs ``(s, 0..B-1, d)`` of one (stage, phase) form a queue. In a chain a job's one
   predecessor has the same b, so by induction every queue runs in b order with non-decreasing ready
   times (its predecessor queue's ends increase along b). The jobs of a queue ready at t are then a
   prefix of what is left of it, and with keys increasing along it the simulator's choice (the
   smallest key among ready jobs the cap allows) is a head: each worker's next job is the smallest
   ``(max(free_at, ready), key)`` among its queue heads.
2. *Windows.* Let t* be the earliest decision and d the shortest duration. Nothing not started yet
   ends before t* + d (float rounding is monotone), so all workers deciding below t* + d are taken
   in one step, each once (its job lasts d at least), as the simulation decides.
3. *Same floats.* Starts are ends or maxima of ends, ends are start + duration, busy times add
   durations in each worker's order: the simulator's operations, so the timeline is equal, not
   close (tests/test_schedule_sweep.py). A cap too small raises the simulator's error."""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np

from lightning_gsched.schedule.jobs import Job, StageGraph
from lightning_gsched.schedule.lazy_ranks import LazyList
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.priorities import dense_ranks
from lightning_gsched.schedule.reserve import stash_charges
from lightning_gsched.schedule.simulate import Costs, Timeline, stuck_error

_NO_CAP = _LAST_KEY = np.iinfo(np.int64).max


def sweepable(graph: StageGraph, table: PlacementTable) -> bool:
    """A chain whose every stage is computed on one worker for all microbatches (a reserving
    placement then charges every forward of a queue alike: its best allowed forward is its head)."""
    return graph.is_chain and all(row.count(row[0]) == len(row) for row in table.compute)


# rough costs (bench_planner.py): a window's numpy calls, per queue cell, an event-simulated job
_WINDOW_US, _CELL_US, _JOB_US = 60.0, 0.015, 5.0


def worth_sweeping(table: PlacementTable, phases: int) -> bool:
    """Whether the sweep should beat the job-by-job simulation. It pays per time window, about one
    per job of the busiest worker plus fill and drain (two passes over the stages): cheap when
    many workers decide per window, slow for a long chain with few microbatches."""
    W, S, B = table.workers, table.stages, table.micro
    stages_per_worker = -(-S // W)
    cells = stages_per_worker * phases * W
    windows = stages_per_worker * phases * B + 2 * S
    return windows * (_WINDOW_US + _CELL_US * cells) < _JOB_US * S * B * phases


def keys_increase_in_micro(keys: np.ndarray, stages: int, micro: int, phases: int) -> bool:
    """Whether every (stage, phase) queue's keys increase with b (docstring, item 1). Compared
    in place, not through ``np.diff``: at W=1024 the keys are 12.6 million int64s, and a
    difference array as large costs more in fresh pages than the comparison itself."""
    grid = keys.reshape(stages, micro, phases)
    return bool(np.all(grid[:, 1:, :] > grid[:, :-1, :]))


class WorkerOrders(LazyList[list[int]]):
    """``Timeline.order`` as one int array (worker after worker, from ``offsets``), a worker's
    list made when read: a rank lowering its own program never makes the others' Python ints."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat, self.offsets = flat, offsets
        super().__init__(len(offsets) - 1, self._worker)

    def _worker(self, w: int) -> list[int]:
        return self.flat[self.offsets[w]:self.offsets[w + 1]].tolist()  # type: ignore[no-any-return]


class _Queues:
    """Every worker's queues as the cells ``slot * W + worker`` of a K x W grid (K: the most
    queues a worker has), so a per-worker minimum is K - 1 element-wise minima of contiguous rows
    (numpy reduces a short last axis slowly). Queue (s, d) holds ``(s, b, d)``, flat job index
    ``base + b * P``; a cell past a worker's queues is empty (no jobs, never ready)."""

    def __init__(self, graph: StageGraph, table: PlacementTable, costs: Costs) -> None:
        W, S, B = table.workers, table.stages, table.micro
        P = len(graph.phases)
        stage = np.repeat(np.arange(S, dtype=np.int64), P)  # queue (s, d) at s * P + d
        phase = np.tile(np.arange(P, dtype=np.int64), S)
        worker = np.array([row[0] for row in table.compute], dtype=np.int64)[stage]
        counts = np.bincount(worker, minlength=W)
        K = int(counts.max())
        slot = np.empty(S * P, dtype=np.int64)
        by_worker = np.argsort(worker, kind="stable")
        slot[by_worker] = np.arange(S * P) - np.repeat(np.cumsum(counts) - counts, counts)
        cell = slot * W + worker  # of every queue

        def grid(values: np.ndarray, empty: float | int, dtype: type) -> np.ndarray:
            out: np.ndarray = np.full(K * W, empty, dtype=dtype)
            out[cell] = values
            return out

        durations = np.array([costs.by_phase()[d] for d in graph.phases], dtype=np.float64)
        self.width = K
        self.base = grid(stage * B * P + phase, 0, np.int64)
        self.duration = grid(durations[phase, stage], np.inf, np.float64)
        self.jobs = grid(np.full(S * P, B), 0, np.int64)  # jobs in each queue (0: empty cell)
        self.forward = grid(phase == 0, False, np.bool_)
        # what a forward adds to its worker's count under the cap: 1, or its reserving charge
        # (reserve.py), the same for every microbatch here, so microbatch 0's column gives it
        charge = np.array(stash_charges([row[:1] for row in table.compute]) if table.reserves_stash
                          else [1] * S, dtype=np.int64)
        self.charge = grid(np.where(phase == 0, charge[stage], 0), 0, np.int64)
        # the stash is freed by the last backward phase: B, or W when split
        self.releases = grid((phase == P - 1) & (phase > 0), 0, np.int64)
        self.shortest = float(durations.min()) if durations.size else 1.0
        # successors in a chain as the flat index of their b = 0 job (-1: none): F s -> F s+1
        # (the last stage's F -> its B); B s -> B s-1, and W s when split
        succ_a, succ_b = np.full((2, S * P), -1, dtype=np.int64)
        f, bk = phase == 0, phase == 1
        inner, last = f & (stage < S - 1), f & (stage == S - 1)
        succ_a[inner] = (stage[inner] + 1) * B * P
        if P > 1:
            succ_a[last] = (S - 1) * B * P + 1
            back = bk & (stage > 0)
            succ_a[back] = (stage[back] - 1) * B * P + 1
            succ_b[bk] = stage[bk] * B * P + 2
        # per cell, one column per kind of successor (gathered at once); no successor points
        # at the sink job J and the sink cell K * W, so the loop needs no filtering
        kinds = (succ_a, succ_b) if P == 3 else (succ_a,)
        self.succ = np.full((K * W, len(kinds)), S * B * P, dtype=np.int64)
        self.succ_cell = np.full((K * W, len(kinds)), K * W, dtype=np.int64)
        for kind, succ in enumerate(kinds):
            has = succ >= 0
            queue = (succ[has] // (B * P)) * P + succ[has] % P
            self.succ[cell[has], kind] = succ[has]
            self.succ_cell[cell[has], kind] = cell[queue]


def simulate_sweep(graph: StageGraph, table: PlacementTable, keys: np.ndarray, costs: Costs,
                   caps: Sequence[int | None]) -> Timeline:
    """The timeline :func:`.simulate.simulate` gives for ``keys``' order (int64 per flat job
    index). The caller checks :func:`sweepable` and :func:`keys_increase_in_micro`."""
    W, S, B = table.workers, table.stages, table.micro
    P = len(graph.phases)
    J = S * B * P
    q = _Queues(graph, table, costs)
    K, cells = q.width, q.width * W
    cap = np.array([_NO_CAP if c is None else c for c in caps], dtype=np.int64)
    capped = bool(np.any(cap != _NO_CAP))
    if len(keys) and int(keys.max()) >= _LAST_KEY // (cells + 1):  # room for the cell digits
        keys = dense_ranks(keys)  # the same order, in ints below J
    ready = np.full(J + 1, np.inf)  # and the sink job J (sweep successors that do not exist)
    ready[0:B * P:P] = 0.0  # F 0 b: sources
    # the timeline's own storage, written through numpy views (no copy at the end); made by
    # repetition, which writes each page once (from a zeroed bytes object: twice, and a
    # second buffer as large: 200 MB more first-touched pages per array at W=1024)
    start_times, end_times = array("d", [0.0]) * J, array("d", [0.0]) * J
    start, end = (np.frombuffer(times, dtype=np.float64) for times in (start_times, end_times))
    # each worker's order, written in place: worker w's jobs from offsets[w] on
    per_worker = np.bincount(np.arange(cells) % W, weights=q.jobs, minlength=W).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(per_worker)))
    flat, cursor = np.empty(J, dtype=np.int64), offsets[:-1].copy()
    busy, free_at, stash = np.zeros(W), np.zeros(W), np.zeros(W, dtype=np.int64)
    # per cell, and the sink cell: its head's flat job, ready time and key; the key carries
    # the cell in its low digits, so a worker's smallest key names the cell it takes
    head = np.append(q.base, -1)  # the sink cell's head matches no job
    head_ready = np.append(np.where(q.jobs > 0, ready[q.base], np.inf), np.inf)
    head_key = keys[np.minimum(head, J - 1)] * (cells + 1) + np.arange(cells + 1, dtype=np.int64)
    ready_grid, key_grid = head_ready[:cells].reshape(K, W), head_key[:cells].reshape(K, W)  # views
    forward_grid, charge_grid = q.forward.reshape(K, W), q.charge.reshape(K, W)
    last = (B - 1) * P  # a queue's last job: b * P = last
    placed = 0
    while placed < J:
        if capped:
            at = np.where(forward_grid & (stash + charge_grid > cap), np.inf, ready_grid)
            np.maximum(at, free_at, out=at)
        else:
            at = np.maximum(ready_grid, free_at)
        when = np.minimum.reduce(at, axis=0)  # each worker's earliest start
        first = when.min()
        if first == np.inf:
            raise _stuck(q, head, ready, stash, cap, caps, B, P, placed, J, graph)
        # every worker's choice: the smallest key among its heads startable at ``when``
        best = np.minimum.reduce(np.where(at == when, key_grid, _LAST_KEY), axis=0)
        rows = np.flatnonzero(when < first + q.shortest)
        when_rows = when[rows]
        cell = best[rows] % (cells + 1)
        chosen = head[cell]
        ends = when_rows + q.duration[cell]
        start[chosen] = when_rows
        end[chosen] = ends
        free_at[rows] = ends
        busy[rows] += ends - when_rows  # the simulator's sum: in each worker's order
        at_cursor = cursor[rows]
        flat[at_cursor] = chosen
        cursor[rows] = at_cursor + 1
        if capped:
            stash[rows] += q.charge[cell]
            stash[rows] -= q.releases[cell]
        # the queue's next job (b + 1, the next flat index of its queue) becomes its head
        offset = chosen - q.base[cell]  # b * P: also the successors' microbatch
        following = chosen + P
        head[cell] = following
        head_ready[cell] = np.where(offset < last, ready[np.minimum(following, J)], np.inf)
        head_key[cell] = keys[np.minimum(following, J - 1)] * (cells + 1) + cell
        # successors: ready when this job ends; a queue waiting on one has its head ready
        target = np.minimum(q.succ[cell] + offset[:, None], J)
        arrives = np.broadcast_to(ends[:, None], target.shape)
        ready[target] = arrives
        where = q.succ_cell[cell]
        is_head = head[where] == target
        head_ready[where[is_head]] = arrives[is_head]
        placed += len(rows)

    def sequence() -> list[int]:  # the simulator's placement order: by (start, key)
        return np.lexsort((keys[:J], start)).tolist()  # type: ignore[no-any-return]

    return Timeline(W, S, B, graph.phases, WorkerOrders(flat, offsets), start_times, end_times,
                    sequence, busy.tolist(), latency=float(end.max()) if J else 0.0)


def _stuck(q: _Queues, head: np.ndarray, ready: np.ndarray, stash: np.ndarray, cap: np.ndarray,
           caps: Sequence[int | None], B: int, P: int, placed: int, total: int,
           graph: StageGraph) -> Exception:
    """The simulator's error; a worker's first waiting forward is the smallest flat index of an
    F whose input has arrived (a queue head)."""
    shape = (q.width, len(stash))
    jobs = head[:-1].reshape(shape)  # without the sink cell
    left = (jobs - q.base.reshape(shape)) < q.jobs.reshape(shape) * P
    waiting = left & q.forward.reshape(shape) & np.isfinite(ready[np.minimum(jobs, len(ready) - 1)])
    refused = waiting & (stash + q.charge.reshape(shape) > cap)
    blocked = []
    for w in np.flatnonzero(refused.any(axis=0)).tolist():
        stage, b = divmod(int(jobs[:, w][refused[:, w]].min()) // P, B)
        blocked.append((w, int(stash[w]), int(cap[w]), Job(stage, b, graph.phases[0])))
    return stuck_error(blocked, placed, total, caps)

