"""Lower tied weights: who fetches, holds, reduces and all-reduces each tie, and where.

A tie (``Programs.ties``: home stage -> reader stages) is one weight unit owned with its home
stage (``table.owners[home]``). Why it is not simply part of the home stage's buffer: a rank
that computes a reader stage other than the home (the output head on the last stage reading a
tied embedding) needs the tie but not the rest of the home stage, and a rank that fetches the
home stage per run must not lose the tie between runs. So the tie has its own residency rule:

* an owner that computes reader jobs needs nothing (it holds the tie all step);
* a non-owner that computes reader jobs fetches the tie once (``FETCH_T`` posted one compute
  before its first reader job, from ``table.fetch_source[(home, rank)]`` when it fetches the
  home stage from someone, else the first owner), holds it to its last reader job
  (``FREE_T`` right after) and sends its accumulated gradient to that owner right after its
  last weight-gradient job of a reader stage (``REDUCE_T``; B, or W under a split backward).
  Holding for the step instead of per run: a tie is typically read at both ends of the
  model, and re-fetching it per run would multiply the traffic;
* owners serve (``SEND_T``) and receive (``RECV_T``) at the point of their program matching
  the simulated time the peer needs them, as for stage weights; several owners all-reduce
  the tie (``ALLREDUCE_T``) after their own last reader weight-gradient job and after every
  ``RECV_T`` they get;
* a rank that computes no reader stage holds nothing of the tie.

Forward-only programs get the fetch, the serve and the free only. Kept apart from
:mod:`.lower` (which calls :func:`lower_ties` with its builder) so that the stage-weight
lowering stays as it is.
"""

from __future__ import annotations

from typing import Mapping, Protocol

from lightning_gsched.schedule.jobs import Phase
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import Action, Op, RankGroup
from lightning_gsched.schedule.simulate import Timeline


class ActionSink(Protocol):
    """What the tie lowering needs of the lowering's builder."""

    def put(self, rank: int, gap: int, time: float, action: Action) -> None: ...
    def gap_at(self, rank: int, time: float) -> int: ...


def lower_ties(
    ties: Mapping[int, tuple[int, ...]], table: PlacementTable, timeline: Timeline,
    build: ActionSink, grad_phase: Phase, forward_only: bool,
) -> None:
    """Put every tie's actions into the builder (see the module docstring)."""
    P = len(timeline.phases)
    BP = table.micro * P
    grad_k = timeline.phases.index(grad_phase) if grad_phase in timeline.phases else -1
    start, end = timeline.start, timeline.end
    for home, readers in ties.items():
        owners = table.owners[home]
        reading = set(readers)
        recv_gaps: dict[int, int] = {}  # owner -> latest gap where it posts a RECV_T
        own_last_grad: dict[int, tuple[int, float]] = {}  # owner -> (gap after, time)
        for worker, order in enumerate(timeline.order):  # flat job indices, in order
            jobs = [i for i, flat in enumerate(order) if flat // BP in reading]
            if not jobs:
                continue
            grads = [] if forward_only else [i for i in jobs if order[i] % P == grad_k]
            if worker in owners:
                if grads:
                    own_last_grad[worker] = (grads[-1] + 1, end[order[grads[-1]]])
                continue
            first, last = jobs[0], jobs[-1]
            source = table.fetch_source.get((home, worker), owners[0])
            fetch_gap = max(first - 1, 0)
            prefetch_time = start[order[fetch_gap]] if first > 0 else 0.0
            build.put(worker, fetch_gap, prefetch_time, Action(Op.FETCH_T, home, None, source))
            build.put(source, build.gap_at(source, prefetch_time), prefetch_time,
                      Action(Op.SEND_T, home, None, worker))
            if grads:
                grad_end = end[order[grads[-1]]]
                build.put(worker, grads[-1] + 1, grad_end,
                          Action(Op.REDUCE_T, home, None, source))
                gap = build.gap_at(source, grad_end)
                build.put(source, gap, grad_end, Action(Op.RECV_T, home, None, worker))
                recv_gaps[source] = max(recv_gaps.get(source, 0), gap)
            build.put(worker, last + 1, end[order[last]], Action(Op.FREE_T, home))
        if len(owners) < 2 or forward_only:
            continue
        group = RankGroup(owners)  # one object for all members: hashed once
        for owner in group:
            gap, time = own_last_grad.get(owner, (0, 0.0))
            gap = max(gap, recv_gaps.get(owner, 0))
            build.put(owner, gap, time, Action(Op.ALLREDUCE_T, home, None, None, group))
