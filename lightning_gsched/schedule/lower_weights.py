"""The lowering's weight rules: fetch, hold, free and reduce a stage; all-reduce its replicas.

A worker that does not own stage s fetches it once per *run* (:func:`stage_runs`): ``FETCH_W``
posted one compute early (with a ``fetch_window`` of k, not before the ``FREE_W`` of the k-th
fetched run before it), ``FREE_W`` right after the run, preceded by ``REDUCE_G`` to the owner if
the run accumulated weight gradients, as FSDP reduces after each backward instead of holding
gradients of weights it no longer has. The owner's ``SEND_W`` and ``RECV_G`` go where
its program meets the simulated time the peer needs them (:meth:`.lower_build.Builder.gap_at`).
Replicas (several owners of a stage) all-reduce right after their last weight-gradient job of
the stage and every ``RECV_G`` of it, overlapping the rest of the backward pass. A tie is a
weight unit held for the step by the same ops (:meth:`WeightLowering._tie`).
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

from lightning_gsched.schedule.jobs import StageGraph, weight_grad_phase
from lightning_gsched.schedule.lower_build import Builder
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import Action, Op, RankGroup
from lightning_gsched.schedule.simulate import Timeline

Run = tuple[int, int, int, int]  # (stage, first position, last position, fetch gap)
Ties = Mapping[int, tuple[int, ...]]  # home stage -> every stage reading the tie
Index = tuple[list[tuple[int, int, int]], dict[int, list[tuple[int, int]]]]  # WeightLowering._index


def stage_runs(stages: Sequence[int], whole_step: bool) -> list[tuple[int, int, int]]:
    """(stage, i, j) of every run (a maximal block of computes of one stage, ``stages`` giving
    each compute's), by first compute. With ``whole_step`` (a sharded data-parallel placement:
    ``PlacementTable.hold_fetched_for_step``) a run spans the stage's first compute of the step
    to its last: fetched once, its gradient reduced once."""
    if whole_step:
        first: dict[int, int] = {}
        for index, stage in enumerate(stages):
            first.setdefault(stage, index)
        last = {stage: index for index, stage in enumerate(stages)}
        return [(stage, i, last[stage]) for stage, i in first.items()]
    starts = [i for i in range(len(stages)) if not i or stages[i] != stages[i - 1]]
    return [(stages[i], i, j - 1) for i, j in zip(starts, [*starts[1:], len(stages)], strict=True)]


class WeightLowering:
    """The weight actions of a timeline, for the ranks a builder keeps. Its indexes are built
    once for every rank lowered; by symmetry a worker's runs are its replica position's."""

    def __init__(self, graph: StageGraph, table: PlacementTable, timeline: Timeline,
                 fetch_window: int | None, ties: Ties | None) -> None:
        self.table, self.timeline, self.fetch_window = table, timeline, fetch_window
        self.forward_only, self.ties = graph.forward_only, dict(ties or {})
        grad_phase, phases = weight_grad_phase(graph.split_backward), timeline.phases
        self.grad_k = phases.index(grad_phase) if grad_phase in phases else -1
        self._runs: dict[int, Index] = {}
        self._fetchers: dict[int, list[int]] | None = None
        self._groups: dict[int, RankGroup] = {}

    def lower(self, build: Builder) -> None:
        """Fetches, serves, frees and reductions, then the replicas' all-reduces; then ties'."""
        reduce_gaps = self._fetched(build)
        if not self.forward_only:
            self._allreduce(build, reduce_gaps)
        for home, readers in self.ties.items():
            self._tie(build, home, set(readers))

    def _fetched(self, build: Builder) -> dict[tuple[int, int], int]:
        """Every fetched run of a kept rank or served by one; returns per (owner, stage) the
        latest gap where the owner posts a gradient receive."""
        reduce_gaps: dict[tuple[int, int], int] = {}
        keep, table, timeline = build.keep, self.table, self.timeline
        P = len(timeline.phases)
        BP = table.micro * P
        workers: Collection[int] = range(table.workers) if keep is None else sorted(
            {*keep, *(w for rank in keep for w in self._fetchers_of(rank))})
        for worker in workers:
            jobs = timeline.order[worker]
            runs = (self._fetched_runs(worker) if keep is None or worker in keep
                    else self._served(worker, keep))
            for stage, i, j, fetch_gap in runs:
                reduces = any(jobs[k] % P == self.grad_k and jobs[k] // BP == stage
                              for k in range(i, j + 1))
                put_unit_run(timeline, build, worker, stage, table.fetch_source[(stage, worker)],
                             i, j, fetch_gap, reduces, reduce_gaps)
        return reduce_gaps

    def _index(self, worker: int) -> Index:
        """(stage, i, j) of every run of ``worker``'s order, and per stage its (i, j)."""
        replicas = self.timeline.replicas
        key = replicas.position(worker) if replicas is not None else worker
        runs = self._runs.get(key)
        if runs is None:
            BP = self.table.micro * len(self.timeline.phases)
            stages = [flat // BP for flat in self.timeline.order[worker]]
            listed = stage_runs(stages, self.table.hold_fetched_for_step)
            by_stage: dict[int, list[tuple[int, int]]] = {}
            for stage, i, j in listed:
                by_stage.setdefault(stage, []).append((i, j))
            runs = self._runs[key] = (listed, by_stage)
        return runs

    def _fetched_runs(self, worker: int) -> list[Run]:
        """Every run ``worker`` fetches, with its fetch gap (the module docstring's rule)."""
        table = self.table
        owned = set(table.owned_stages(worker))
        if table.computed_stages(worker) <= owned:
            return []  # computes only stages it owns: nothing to fetch
        out: list[Run] = []
        freed_at: list[int] = []  # gap of the FREE_W of each fetched run so far
        window = self.fetch_window
        for stage, i, j in self._index(worker)[0]:
            if stage in owned:
                continue
            fetch_gap = max(i - 1, 0)
            if window is not None and len(freed_at) >= window:
                fetch_gap = max(fetch_gap, freed_at[-window])
            out.append((stage, i, j, fetch_gap))
            freed_at.append(j + 1)
        return out

    def _served(self, worker: int, owners: Collection[int]) -> list[Run]:
        """The runs of ``worker`` that fetch a stage from one of ``owners``, in its order."""
        table = self.table
        if self.fetch_window is not None:  # a fetch gap depends on the runs before it
            return [run for run in self._fetched_runs(worker)
                    if table.fetch_source[(run[0], worker)] in owners]
        owned = set(table.owned_stages(worker))
        by_stage = self._index(worker)[1]
        return sorted(((stage, i, j, max(i - 1, 0))
                       for owner in owners for stage in table.owned_stages(owner)
                       if stage not in owned and table.fetch_source.get((stage, worker)) == owner
                       for i, j in by_stage.get(stage, ())), key=lambda run: run[1])

    def _fetchers_of(self, owner: int) -> list[int]:
        if self._fetchers is None:
            index: dict[int, set[int]] = {}
            for (_, worker), source in self.table.fetch_source.items():
                index.setdefault(source, set()).add(worker)
            self._fetchers = {w: sorted(ws) for w, ws in index.items()}
        return self._fetchers.get(owner, [])

    def _allreduce(self, build: Builder, reduce_gaps: dict[tuple[int, int], int]) -> None:
        """Each kept replica owner's ``ALLREDUCE_G`` of a stage, after its last gradient job of
        it (and its gradient receives): by stage, then owner, as for every rank."""
        owners, keep = self.table.owners, build.keep
        P = len(self.timeline.phases)
        BP = self.table.micro * P
        end, order = self.timeline.end, self.timeline.order
        last: dict[int, dict[int, tuple[int, float]]] = {}  # rank -> stage -> (gap, time)

        def last_of(rank: int) -> dict[int, tuple[int, float]]:
            if rank not in last:
                mine = last[rank] = {}
                for i, flat in enumerate(order[rank]):
                    if flat % P == self.grad_k:
                        mine[flat // BP] = (i + 1, end[flat])
            return last[rank]

        stages = range(len(owners)) if keep is None else sorted(
            {s for rank in keep for s in self.table.owned_stages(rank)})
        for stage in stages:
            if len(owners[stage]) < 2:
                continue
            # one object for all members and lowerings: hashed once (see RankGroup)
            group = self._groups.setdefault(stage, RankGroup(owners[stage]))
            for owner in group:
                if keep is None or owner in keep:
                    gap, time = last_of(owner).get(stage, (0, 0.0))
                    gap = max(gap, reduce_gaps.get((owner, stage), 0))
                    build.put(owner, gap, time, Action(Op.ALLREDUCE_G, stage, None, None, group))

    def _tie(self, build: Builder, home: int, readers: set[int]) -> None:
        """A tie, typically read at both ends of the model, held for the step: a non-owner fetches
        it before its first reader job (from its source of ``home``, else the first owner) and
        hands back the gradient after its last; owners all-reduce it after their last reader
        gradient job and every gradient they receive."""
        table, timeline, forward_only = self.table, self.timeline, self.forward_only
        P = len(timeline.phases)
        BP = table.micro * P
        owners = table.owners[home]
        recv_gaps: dict[tuple[int, int], int] = {}
        own_last: dict[int, tuple[int, float]] = {}  # owner -> (gap after, time)
        for worker, order in enumerate(timeline.order):  # flat job indices, in order
            jobs = [i for i, flat in enumerate(order) if flat // BP in readers]
            if not jobs:
                continue
            grads = [] if forward_only else [i for i in jobs if order[i] % P == self.grad_k]
            if worker in owners:
                if grads:
                    own_last[worker] = (grads[-1] + 1, timeline.end[order[grads[-1]]])
                continue
            source = table.fetch_source.get((home, worker), owners[0])
            # the last reader job of a training step is a gradient job (every F is followed by
            # its B, and a split B by its W, on the same worker): the run ends with the reduce
            put_unit_run(timeline, build, worker, home, source, jobs[0], jobs[-1],
                         max(jobs[0] - 1, 0), bool(grads), recv_gaps, tie=True)
        if len(owners) < 2 or forward_only:
            return
        group = RankGroup(owners)  # one object for all members: hashed once
        for owner in group:
            gap, time = own_last.get(owner, (0, 0.0))
            gap = max(gap, recv_gaps.get((owner, home), 0))
            build.put(owner, gap, time, Action(Op.ALLREDUCE_G, home, None, None, group, True))


def put_unit_run(timeline: Timeline, build: Builder, worker: int, unit: int, owner: int,
                 i: int, j: int, fetch_gap: int, reduces: bool,
                 reduce_gaps: dict[tuple[int, int], int], tie: bool = False) -> None:
    """A weight unit (stage ``unit``, or with ``tie`` the tie of home ``unit``) held by ``worker``
    from its compute i to j: the fetch and the owner's serve at the time it is needed, then the
    gradient handed to the owner (``reduces``) and the free."""
    jobs = timeline.order[worker]
    prefetch_time = timeline.start[jobs[fetch_gap]] if i > 0 else 0.0
    build.put(worker, fetch_gap, prefetch_time, Action(Op.FETCH_W, unit, None, owner, None, tie))
    build.put(owner, build.gap_at(owner, prefetch_time), prefetch_time,
              Action(Op.SEND_W, unit, None, worker, None, tie))
    run_end = timeline.end[jobs[j]]
    if reduces:
        build.put(worker, j + 1, run_end, Action(Op.REDUCE_G, unit, None, owner, None, tie))
        gap = build.gap_at(owner, run_end)
        build.put(owner, gap, run_end, Action(Op.RECV_G, unit, None, worker, None, tie))
        key = (owner, unit)
        reduce_gaps[key] = max(reduce_gaps.get(key, 0), gap)
    build.put(worker, j + 1, run_end, Action(Op.FREE_W, unit, None, None, None, tie))
