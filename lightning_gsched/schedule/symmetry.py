"""The timeline by group symmetry: simulate one group of workers, rename it for the others. The
compute of the looped family (ddp and fsdp are R = 1; lpp, fslpp and fslpp-seed any R dividing
W) splits into G identical independent groups: group ``g`` runs the microbatches ``b = g + G*m``
on the workers ``g*R + p`` (p computing the stages ``s mod R == p``). The renaming is exact:

- every decision of the simulator compares the (start, rank) keys of one group's jobs only (a
  worker's queues hold its own jobs; a job's successors run in its group), so a group's run
  depends only on its jobs and the *relative* order of their ranks;
- a library order ranks jobs by loops monotone in ``b``, so ``b = g + G*m`` orders as ``m`` does
  in every group: every group's relative order is that of ``LPP(R, R)`` on B/G microbatches;
- costs are per stage, and the caps must repeat with period R (checked; else no fast path).

So group g's start, end and order are group 0's with ``b = G*m`` renamed to ``g + G*m`` and
worker ``p`` to ``g*R + p``, with the same busy sums; the global placement order is a merge of
the G renamed copies by (start, rank), built only when read. All else is simulated in full."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from lightning_gsched.errors import CapTooSmallError
from lightning_gsched.schedule.data_parallel import DataParallel, replica_priority
from lightning_gsched.schedule.jobs import StageGraph
from lightning_gsched.schedule.orders import PriorityFn, layout_of
from lightning_gsched.schedule.placements import LOOPED, LPP, PlacementFn, PlacementTable
from lightning_gsched.schedule.priorities import order_keys, priority_ranks
from lightning_gsched.schedule.replicas import ReplicaLayout
from lightning_gsched.schedule.simulate import Costs, Timeline, simulate
from lightning_gsched.schedule.sweep import (
    keys_increase_in_micro,
    simulate_sweep,
    sweepable,
    worth_sweeping,
)


@dataclass(frozen=True)
class Groups:
    """G replicas of a P-worker schedule: their ``layout``, one replica's placement and order."""

    layout: ReplicaLayout
    placement: PlacementFn
    priority: PriorityFn

    @property
    def count(self) -> int:
        return self.layout.replicas


def groups_of(placement: PlacementFn, priority: PriorityFn, workers: int,
              micro: int) -> Groups | None:
    """The group structure of a placement whose compute splits into G >= 2 replicas, or None: a
    data-parallel lift (:class:`~.data_parallel.DataParallel`) of any P-worker placement and
    priority, or the looped family under a library order, each group running ``LPP(R, R)``."""
    if isinstance(placement, DataParallel):
        inner = replica_priority(priority, placement.layout.replicas)
        if inner is None:
            return None
        group = Groups(placement.layout, placement.inner, inner)
    else:
        if type(placement) not in LOOPED:
            return None
        R: int = getattr(placement, "R", 1)
        if workers % R or layout_of(priority) is None:
            return None
        group = Groups(ReplicaLayout(R, workers // R, pipeline_major=False), LPP(R, R), priority)
    return None if micro % group.count or group.count < 2 else group


def symmetric(groups: Groups | None, caps: Sequence[int | None]) -> bool:
    """Whether renaming one group's run is exact: caps equal at each position in every group."""
    if groups is None:
        return False
    layout = groups.layout
    return all(caps[w] == caps[layout.rank(layout.position(w), 0)] for w in range(len(caps)))


def make_simulator(graph: StageGraph, table: PlacementTable, placement: PlacementFn,
                   priority: PriorityFn, costs: Costs,
                   sweep: bool | None = None) -> Callable[[Sequence[int | None]], Timeline]:
    """``caps -> Timeline``, all ways giving the same timeline: by symmetry where it is exact, by a
    sweep (``sweep`` None: where :func:`.sweep.worth_sweeping` expects it to pay; True: wherever
    it is exact; False: never), else in full. What the caps do not change (the full ranks, the
    group's simulator, the sweep's keys) is made once, and the ranks only if needed."""
    groups = groups_of(placement, priority, table.workers, table.micro)
    full_ranks: list[int] = []
    group_run: list[Callable[[Sequence[int | None]], Timeline]] = []

    def fresh_ranks() -> list[int]:
        return priority_ranks(priority, table.stages, table.micro, graph.forward_only,
                              graph.split_backward)

    def ranks() -> list[int]:  # kept for every cap a full simulation runs with
        if not full_ranks:
            full_ranks.extend(fresh_ranks())
        return full_ranks

    worth = worth_sweeping(table, len(graph.phases)) if sweep is None else sweep
    if worth and groups is None and sweepable(graph, table):
        keys = order_keys(priority, table.stages, table.micro, graph.phases)
        if keys is None:  # a user's order: its ranks are keys too
            keys = np.asarray(ranks(), dtype=np.int64)
        if keys_increase_in_micro(keys, table.stages, table.micro, len(graph.phases)):
            swept = keys
            return lambda caps: simulate_sweep(graph, table, swept, costs, caps)

    def run(caps: Sequence[int | None]) -> Timeline:
        if groups is None or not symmetric(groups, caps):
            return simulate(graph, table, ranks(), costs, caps)
        layout = groups.layout
        if not group_run:
            P, sub_micro = layout.pipeline, table.micro // groups.count
            sub_table = PlacementTable(groups.placement, P, table.stages, sub_micro)
            group_run.append(make_simulator(  # the group decides for itself whether a sweep pays
                graph, sub_table, groups.placement, groups.priority, costs, sweep))
        try:
            group = group_run[0]([caps[layout.rank(p, 0)] for p in range(layout.pipeline)])
        except CapTooSmallError:  # the same failure, with the full plan's names in its message
            return simulate(graph, table, ranks(), costs, caps)
        return expand(group, layout, lambda: full_ranks or fresh_ranks())

    return run


def expand(group: Timeline, layout: ReplicaLayout,
           ranks: Callable[[], Sequence[int]]) -> Timeline:
    """The full timeline from group 0's: G renamed copies. ``ranks``: the full plan's ranks,
    called only if the placement order is read."""
    G, S, P, Bg = layout.replicas, group.stages, len(group.phases), group.micro
    start: list[float] = []
    end: list[float] = []
    group_start, group_end = list(group.start), list(group.end)  # the simulator's lists
    for s in range(S):
        for m in range(Bg):
            at = (s * Bg + m) * P
            start += group_start[at:at + P] * G  # b = m*G + g for g = 0..G-1: the same slot
            end += group_end[at:at + P] * G
    base = [_renamed(jobs, P, Bg, G) for jobs in group.order]
    order: list[list[int]] = [[] for _ in range(layout.workers)]
    for g in range(G):
        for p in range(layout.pipeline):
            order[layout.rank(p, g)] = [j + g * P for j in base[p]] if g else base[p]
    busy = [group.busy[layout.position(w)] for w in range(layout.workers)]

    def sequence() -> list[int]:  # G renamed copies of group 0's, merged by (start, rank)
        full_ranks = ranks()
        renamed = _renamed(group.sequence, P, Bg, G)
        times = [group.start[j] for j in group.sequence]
        heads = [(times[0], full_ranks[renamed[0] + g * P], g, 0) for g in range(G)] \
            if renamed else []
        heapq.heapify(heads)
        out: list[int] = []
        n = len(renamed)
        while heads:
            _, _, g, i = heads[0]
            out.append(renamed[i] + g * P)
            i += 1
            if i < n:
                heapq.heapreplace(heads, (times[i], full_ranks[renamed[i] + g * P], g, i))
            else:
                heapq.heappop(heads)
        return out

    return Timeline(layout.workers, S, Bg * G, group.phases, order, start, end, sequence, busy,
                    replicas=layout)


def _renamed(jobs: Sequence[int], P: int, Bg: int, G: int) -> list[int]:
    """Group 0's flat indices (s*Bg + m)*P + k as the full plan's (s*B + m*G)*P + k."""
    B = Bg * G
    return [((j // P) // Bg * B + (j // P) % Bg * G) * P + j % P for j in jobs]
