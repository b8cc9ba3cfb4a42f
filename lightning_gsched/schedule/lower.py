"""Lower a timeline to one program per rank.

Each worker's compute jobs keep their simulated order. Between two computes ("gaps") the lowering
inserts communication and weight residency:

- outputs: ``SEND_ACT`` right after a forward whose consumer runs elsewhere, ``SEND_GRAD`` right
  after a backward whose producer runs elsewhere (a W, split off a backward, sends nothing);
- inputs: ``RECV_ACT``/``RECV_GRAD`` posted one compute early (before the previous compute), so
  the transfer overlaps that compute (the seed's prefetch thread);
- weights: a worker that does not own stage s fetches it once per *run* of consecutive jobs of s
  (``FETCH_W`` one compute early, ``FREE_W`` right after the run). A run that accumulates weight
  gradients (backwards; W jobs when the backward is split) ends with ``REDUCE_G`` to the owner,
  as FSDP reduces after each backward instead of holding gradients of weights it no longer has.
  So a fetched stage is resident from one compute before its run to the end of the run: at most
  two fetched stages at once (the one computing and the next one prefetched). ``fetch_window=1``
  holds one: a fetch whose previous compute uses another fetched stage is posted after that
  stage's ``FREE_W`` instead (its transfer then no longer overlaps a compute);
- owners: ``SEND_W`` and ``RECV_G`` go into the owner's program at the point matching the
  simulated time the peer needs them; replicas (several owners) get ``ALLREDUCE_G`` right after
  their last backward of the stage, so reduction overlaps the rest of the backward pass.

Tied weights (``ties``) get their own fetch, hold and reduction rule: :mod:`.lower_ties`.

A forward-only timeline (``graph.forward_only``) lowers to forwards, activation messages and
weight fetches only: no run has a backward, so there is no ``REDUCE_G``/``RECV_G``, and replicas
have nothing to all-reduce.

Finally every channel is made FIFO-consistent: receives are posted in the order the peer sends,
moving a post earlier when needed (never later), so that backends without message tags (NCCL)
can run the same programs.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from operator import itemgetter
from typing import Mapping

from lightning_gsched.schedule.jobs import Job, Phase, StageGraph
from lightning_gsched.schedule.lower_ties import lower_ties
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import (
    CHANNEL_OF,
    RECV_FOR_SEND,
    RECV_OPS,
    SEND_OPS,
    Action,
    Op,
    Programs,
)
from lightning_gsched.schedule.simulate import Timeline

# Order of actions inside one gap: hand data to peers first, release memory, serve owners'
# duties, then post the prefetches for the next computes.
_CATEGORY = {
    Op.SEND_ACT: 0, Op.SEND_GRAD: 0, Op.REDUCE_G: 1, Op.FREE_W: 2, Op.SEND_W: 3, Op.RECV_G: 4,
    Op.ALLREDUCE_G: 5, Op.FETCH_W: 6, Op.RECV_ACT: 7, Op.RECV_GRAD: 7,
    # ties (lower_ties.py): the same places as their stage-weight counterparts
    Op.REDUCE_T: 1, Op.FREE_T: 2, Op.SEND_T: 3, Op.RECV_T: 4, Op.ALLREDUCE_T: 5, Op.FETCH_T: 6,
}

# (gap, category, time, serial), then (..., position) once make_fifo placed a receive; compute g
# is keyed (g, 99), after gap g's actions
_Key = tuple[float, ...]
_Ident = tuple[int, "int | None", Op]  # (stage, micro, receive op): what a message carries
_COMPUTE_OP = {Phase.F: Op.F, Phase.B: Op.B, Phase.W: Op.W}


class _Builder:
    """Collects actions per (rank, gap) with sort keys, then flattens them into programs."""

    def __init__(self, timeline: Timeline) -> None:
        self.slots = timeline.by_worker
        self.starts = [[slot.start for slot in slots] for slots in self.slots]
        self.entries: list[list[tuple[_Key, Action]]] = [[] for _ in self.slots]
        self.serial = 0

    def put(self, rank: int, gap: int, time: float, action: Action) -> None:
        self.serial += 1
        self.entries[rank].append(((gap, _CATEGORY[action[0]], time, self.serial), action))

    def gap_at(self, rank: int, time: float) -> int:
        """Gap before the first compute on ``rank`` that starts at or after ``time``."""
        return bisect.bisect_left(self.starts[rank], time)

    def make_fifo(self) -> None:
        """Post receives in each channel's send order by moving posts earlier where needed.

        The k-th send of a message identity on a channel matches the k-th receive of that
        identity (weights of one stage may be fetched several times). Walking the sends from last
        to first, each matched receive takes the smaller of its own key and the key of the
        receive after it, so posts only ever move earlier.
        """
        # (kind, src, dst) -> the sends on that channel; (kind, src, dst) -> identity -> posts
        sends: dict[tuple[str, int, int | None], list[tuple[_Key, _Ident]]] = defaultdict(list)
        recvs: dict[tuple[str, int | None, int], dict[_Ident, list[tuple[_Key, int]]]] = (
            defaultdict(lambda: defaultdict(list))
        )
        for rank, entries in enumerate(self.entries):
            for index, (key, action) in enumerate(entries):
                ident: _Ident
                if action.op in SEND_OPS:
                    ident = (action.stage, action.micro, RECV_FOR_SEND[action.op])
                    sends[(CHANNEL_OF[action.op], rank, action.peer)].append((key, ident))
                elif action.op in RECV_OPS:
                    ident = (action.stage, action.micro, action.op)
                    recvs[(CHANNEL_OF[action.op], action.peer, rank)][ident].append((key, index))
        for (channel, src, dst), sent in sends.items():
            assert dst is not None  # lowering names the peer of every message it emits
            sent.sort()
            waiting = recvs[(channel, src, dst)]
            for queue in waiting.values():
                queue.sort(reverse=True)  # pop() yields the earliest post first
            matched = [waiting[ident].pop()[1] if waiting[ident] else None for _, ident in sent]
            running: _Key | None = None
            for position in reversed(range(len(matched))):
                recv_index = matched[position]
                if recv_index is None:
                    continue  # left unmatched on purpose: the dry run reports it
                key, recv = self.entries[dst][recv_index]
                key = key[:4] if running is None or key[:4] <= running else running
                running = key
                self.entries[dst][recv_index] = ((*key, position), recv)

    def programs(self) -> list[list[Action]]:
        """Flatten: gap g's actions (by category, time, serial) come right before compute g."""
        out = []
        new_tuple, compute_op, first = tuple.__new__, _COMPUTE_OP, itemgetter(0)
        for rank, entries in enumerate(self.entries):
            keyed: list[tuple[_Key, Action]] = [
                ((i, 99), new_tuple(Action, (compute_op[s.job.phase], s.job.stage, s.job.micro,
                                             None, None)))
                for i, s in enumerate(self.slots[rank])
            ]
            keyed.extend(entries)
            keyed.sort(key=first)
            out.append([action for _, action in keyed])
        return out


def lower(graph: StageGraph, table: PlacementTable, timeline: Timeline,
          fetch_window: int | None = None,
          ties: Mapping[int, tuple[int, ...]] | None = None) -> Programs:
    """Turn a simulated timeline into per-rank programs (see the module docstring).

    ``fetch_window``: the most fetched stages a worker may hold at once (None: no limit beyond
    the one-compute-early prefetch, which never holds more than two, so 2 or more is the same).
    ``ties``: tied weights, ``{home stage: reader stages}`` (validated), lowered by
    :func:`~lightning_gsched.schedule.lower_ties.lower_ties`.
    """
    build = _Builder(timeline)
    index: dict[Job, int] = {}
    for slots in timeline.by_worker:
        for i, slot in enumerate(slots):
            index[slot.job] = i

    grad_phase = Phase.W if graph.split_backward else Phase.B  # accumulates weight gradients
    _lower_data_flow(graph, table, timeline, build, index)
    reduce_gaps = _lower_weights(table, timeline, build, grad_phase, fetch_window)
    if not graph.forward_only:
        _lower_allreduce(table, timeline, build, reduce_gaps, grad_phase)
    if ties:
        lower_ties(ties, table, timeline, build, grad_phase, graph.forward_only)
    build.make_fifo()
    edges = [(u, v) for u in range(graph.num_stages) for v in graph.outputs(u)]
    return Programs(build.programs(), table.stages, table.micro, list(table.owners), edges,
                    forward_only=graph.forward_only, split_backward=graph.split_backward,
                    ties=dict(ties or {}))


def _lower_data_flow(
    graph: StageGraph, table: PlacementTable, timeline: Timeline, build: _Builder, index: dict[Job, int]
) -> None:
    """Activation sends/receives after forwards, input-gradient sends/receives after backwards."""
    compute = table.compute
    done: set[tuple[int, int, Phase, int]] = set()  # (producer stage, micro, phase, consumer)
    entries = build.entries
    by_worker = timeline.by_worker
    new_tuple = tuple.__new__  # Job(...)/Action(...) without the NamedTuple __new__ frame
    serial = build.serial  # build.put inlined (two puts per message): same keys, same serials
    kinds = {
        phase: (send, _CATEGORY[send], recv, _CATEGORY[recv])
        for phase, send, recv in ((Phase.F, Op.SEND_ACT, Op.RECV_ACT),
                                  (Phase.B, Op.SEND_GRAD, Op.RECV_GRAD))
    }
    sources = {  # W consumes nothing from another stage: it follows its own B
        (s, d): list(graph.inputs(s) if d is Phase.F else graph.outputs(s) if d is Phase.B else [])
        for s in range(graph.num_stages) for d in graph.phases
    }
    for worker, slots in enumerate(by_worker):
        for i, slot in enumerate(slots):
            s, b, phase = slot.job
            for other in sources[(s, phase)]:
                src = compute[other][b]
                if src == worker:
                    continue
                if not graph.is_chain:  # in a DAG one output may feed two stages on one worker
                    if (other, b, phase, worker) in done:
                        continue
                    done.add((other, b, phase, worker))
                produced = index[new_tuple(Job, (other, b, phase))]
                sent_at = by_worker[src][produced].end
                send, send_cat, recv, recv_cat = kinds[phase]
                serial += 1
                entries[src].append(((produced + 1, send_cat, sent_at, serial),
                                     new_tuple(Action, (send, other, b, worker, None))))
                serial += 1
                entries[worker].append(((max(i - 1, 0), recv_cat, slot.start, serial),
                                        new_tuple(Action, (recv, other, b, src, None))))
    build.serial = serial


def _lower_weights(
    table: PlacementTable, timeline: Timeline, build: _Builder, grad_phase: Phase,
    fetch_window: int | None = None,
) -> dict[tuple[int, int], int]:
    """Fetch/free per run of consecutive jobs of a non-owned stage; reduce grads after the run.

    Only a run that accumulates weight gradients (``grad_phase``: B, or W when the backward is
    split) hands them to the owner. A run's fetch is posted one compute early, but with a
    ``fetch_window`` of k not before the ``FREE_W`` of the k-th fetched run before it (the free
    comes first within a gap). Returns, per (owner, stage), the latest gap where the owner posts
    a gradient receive.
    """
    reduce_gaps: dict[tuple[int, int], int] = {}
    for worker, slots in enumerate(timeline.by_worker):
        freed_at: list[int] = []  # gap of the FREE_W of each fetched run so far
        i = 0
        while i < len(slots):
            stage = slots[i].job.stage
            j = i
            while j + 1 < len(slots) and slots[j + 1].job.stage == stage:
                j += 1
            if not table.is_owner(worker, stage):
                owner = table.fetch_source[(stage, worker)]
                fetch_gap = max(i - 1, 0)
                if fetch_window is not None and len(freed_at) >= fetch_window:
                    fetch_gap = max(fetch_gap, freed_at[-fetch_window])
                prefetch_time = slots[fetch_gap].start if i > 0 else 0.0
                build.put(worker, fetch_gap, prefetch_time,
                          Action(Op.FETCH_W, stage, None, owner))
                build.put(owner, build.gap_at(owner, prefetch_time), prefetch_time,
                          Action(Op.SEND_W, stage, None, worker))
                if any(slots[k].job.phase is grad_phase for k in range(i, j + 1)):
                    end = slots[j].end
                    build.put(worker, j + 1, end, Action(Op.REDUCE_G, stage, None, owner))
                    gap = build.gap_at(owner, end)
                    build.put(owner, gap, end, Action(Op.RECV_G, stage, None, worker))
                    key = (owner, stage)
                    reduce_gaps[key] = max(reduce_gaps.get(key, 0), gap)
                build.put(worker, j + 1, slots[j].end, Action(Op.FREE_W, stage))
                freed_at.append(j + 1)
            i = j + 1
    return reduce_gaps


def _lower_allreduce(
    table: PlacementTable,
    timeline: Timeline,
    build: _Builder,
    reduce_gaps: dict[tuple[int, int], int],
    grad_phase: Phase,
) -> None:
    """Replica owners all-reduce a stage right after their last weight-gradient job of it."""
    last_backward: dict[tuple[int, int], tuple[int, float]] = {}
    for worker, slots in enumerate(timeline.by_worker):
        for i, slot in enumerate(slots):
            if slot.job.phase is grad_phase:
                last_backward[(worker, slot.job.stage)] = (i + 1, slot.end)
    for stage, owners in enumerate(table.owners):
        if len(owners) < 2:
            continue
        for owner in owners:
            gap, time = last_backward.get((owner, stage), (0, 0.0))
            gap = max(gap, reduce_gaps.get((owner, stage), 0))
            build.put(owner, gap, time, Action(Op.ALLREDUCE_G, stage, None, None, owners))
