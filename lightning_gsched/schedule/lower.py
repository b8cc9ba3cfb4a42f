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

Order inside a gap: every action has a category (:data:`_CATEGORY`: hand data to peers first,
release memory, serve owners' duties, then post the prefetches for the next computes) and a
rank's program is its actions sorted by (gap, category, then the order they were made in).
Two families are kept apart because they are built differently and never share a category:

- the data flow (activation and input-gradient messages, categories 0 and 7: the planner's
  largest loop, two actions per message, :mod:`.lower_flow`) is kept as actions with small int
  keys ``gap * 9 + category`` in the order they are made, which is already their order within
  a (gap, category). Their channel (``p2p``) only carries them, so their FIFO fix is done per
  consumer as its receives are made;
- everything else (weights, reductions, all-reduces, ties: categories 1-6, a few per run of a
  stage) goes through :meth:`_Builder.put` with a full key (gap, category, time, serial):
  several owners' serves can land in one gap, ordered by the simulated time the peer needs
  them; :meth:`_Builder.make_fifo` fixes their channels.

The computes (category 8 of their own gap) and both families are then merged by one stable
sort of small ints per rank (:meth:`_Builder.programs`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from operator import itemgetter
from typing import Any, Mapping, Sequence

from lightning_gsched.schedule.jobs import Phase, StageGraph
from lightning_gsched.schedule.lower_flow import (
    RECV_CATEGORY,
    SEND_CATEGORY,
    SLOTS,
    lower_data_flow,
)
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
    RankGroup,
)
from lightning_gsched.schedule.simulate import Timeline

# Order of actions inside one gap: hand data to peers first, release memory, serve owners'
# duties, then post the prefetches for the next computes.
_CATEGORY = {
    Op.SEND_ACT: SEND_CATEGORY, Op.SEND_GRAD: SEND_CATEGORY, Op.REDUCE_G: 1, Op.FREE_W: 2,
    Op.SEND_W: 3, Op.RECV_G: 4, Op.ALLREDUCE_G: 5, Op.FETCH_W: 6,
    Op.RECV_ACT: RECV_CATEGORY, Op.RECV_GRAD: RECV_CATEGORY,
    # ties (lower_ties.py): the same places as their stage-weight counterparts
    Op.REDUCE_T: 1, Op.FREE_T: 2, Op.SEND_T: 3, Op.RECV_T: 4, Op.ALLREDUCE_T: 5, Op.FETCH_T: 6,
}
_COMPUTE_KEY = 8  # a compute closes its gap: after every category of it

# (gap, category, time, serial), then (..., position) for a receive on a channel whose posts
# make_fifo had to reorder; gap g's actions come right before compute g
_Key = tuple[Any, ...]
_Ident = tuple[int, "int | None", Op]  # (stage, micro, receive op): what a message carries
_Channel = tuple[str, int, int]  # (kind, src rank, dst rank)
_COMPUTE_OP = {Phase.F: Op.F, Phase.B: Op.B, Phase.W: Op.W}


class _Builder:
    """Collects actions per rank, then sorts them into programs.

    ``entries[rank]``: (key, action) of what :meth:`put` receives (weights, reductions,
    all-reduces, ties). Every send and receive put is also filed under its channel (so that
    :meth:`make_fifo` does not classify all actions again): ``sends[(kind, src, dst)]`` holds
    (key, identity) of each send, ``recvs[(kind, src, dst)]`` (key, identity, index in the
    receiver's entries) of each receive. ``flow[rank]`` / ``flow_keys[rank]``: the data-flow
    actions and their small keys (see the module docstring), filled by :func:`~.lower_flow.lower_data_flow`.
    """

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        start = timeline.start
        self.starts = [list(map(start.__getitem__, jobs)) for jobs in timeline.order]
        self.entries: list[list[tuple[_Key, Action]]] = [[] for _ in timeline.order]
        self.flow: list[list[Action]] = [[] for _ in timeline.order]
        self.flow_keys: list[list[int]] = [[] for _ in timeline.order]
        self.serial = 0
        self.sends: dict[_Channel, list[tuple[_Key, _Ident]]] = defaultdict(list)
        self.recvs: dict[_Channel, list[tuple[_Key, _Ident, int]]] = defaultdict(list)

    def put(self, rank: int, gap: int, time: float, action: Action) -> None:
        self.serial += 1
        key = (gap, _CATEGORY[action[0]], time, self.serial)
        entries = self.entries[rank]
        entries.append((key, action))
        op = action.op
        if op in SEND_OPS:
            assert action.peer is not None  # lowering names the peer of every message it emits
            self.sends[(CHANNEL_OF[op], rank, action.peer)].append(
                (key, (action.stage, action.micro, RECV_FOR_SEND[op])))
        elif op in RECV_OPS:
            assert action.peer is not None
            self.recvs[(CHANNEL_OF[op], action.peer, rank)].append(
                (key, (action.stage, action.micro, op), len(entries) - 1))

    def gap_at(self, rank: int, time: float) -> int:
        """Gap before the first compute on ``rank`` that starts at or after ``time``."""
        return bisect.bisect_left(self.starts[rank], time)

    def make_fifo(self) -> None:
        """Post receives in each channel's send order by moving posts earlier where needed.

        For the actions of :meth:`put` (the data flow's channel is fixed as it is made). The
        k-th send of a message identity on a channel matches the k-th receive of that identity
        (weights of one stage may be fetched several times). Walking the sends from last to
        first, each matched receive takes the smaller of its own key and the key of the receive
        after it, so posts only ever move earlier.
        """
        second = itemgetter(1)
        for (channel, src, dst), sent in self.sends.items():
            sent.sort()  # keys are unique: send order on the channel
            posts = sorted(self.recvs.get((channel, src, dst), ()))  # post order
            if list(map(second, sent)) == list(map(second, posts)):
                # the usual case: posts already carry the same messages in the same order, so
                # the k-th send matches the k-th post, and no post has to move (its key is
                # already no later than the next one's; keys stay unique by their serial)
                continue
            matched: list[int | None]
            if len(set(map(second, posts))) == len(posts):  # each message posted once
                index_of = {ident: index for _, ident, index in posts}
                matched = [index_of.pop(ident, None) for _, ident in sent]
            else:  # weights of one stage fetched several times: k-th send, k-th post
                waiting: dict[_Ident, list[int]] = defaultdict(list)
                for _, ident, index in reversed(posts):
                    waiting[ident].append(index)  # pop() yields the earliest post first
                matched = [waiting[ident].pop() if waiting[ident] else None
                           for _, ident in sent]
            entries = self.entries[dst]
            running: _Key | None = None
            for position in reversed(range(len(matched))):
                recv_index = matched[position]
                if recv_index is None:
                    continue  # left unmatched on purpose: the dry run reports it
                key, recv = entries[recv_index]  # its own 4-part key: matched once
                if running is not None and key > running:
                    key = running
                running = key
                entries[recv_index] = (key + (position,), recv)

    def programs(self, computes: list[Action]) -> list[list[Action]]:
        """Merge each rank's computes (``computes`` by flat job index), data flow and other
        actions: by gap, then category, then the order within each family.

        The other actions are sorted by their full keys first; from then on every action has a
        small int key (gap * 9 + category, a compute 8 in its own gap), and one stable sort of
        those ints keeps each family's order where keys are equal (equal keys are always of one
        family: the families never share a category).
        """
        return [self.program(rank, list(map(computes.__getitem__, jobs)))
                for rank, jobs in enumerate(self.timeline.order)]

    def program(self, rank: int, computes: list[Action]) -> list[Action]:
        """One rank's program: its ``computes`` (in its order) merged with its other actions."""
        first = itemgetter(0)
        entries = self.entries[rank]
        entries.sort(key=first)  # keys are unique (serial): a total order
        actions = self.flow[rank] + list(map(itemgetter(1), entries))
        actions += computes
        keys = self.flow_keys[rank] + [gap * SLOTS + category for gap, category, *_
                                       in map(first, entries)]
        keys += range(_COMPUTE_KEY, SLOTS * len(computes), SLOTS)
        return list(map(actions.__getitem__, sorted(range(len(keys)), key=keys.__getitem__)))


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
    grad_phase = Phase.W if graph.split_backward else Phase.B  # accumulates weight gradients
    lower_data_flow(graph, table, timeline, build.flow, build.flow_keys)
    reduce_gaps = _lower_weights(table, timeline, build, grad_phase, fetch_window)
    if not graph.forward_only:
        _lower_allreduce(table, timeline, build, reduce_gaps, grad_phase)
    if ties:
        lower_ties(ties, table, timeline, build, grad_phase, graph.forward_only)
    build.make_fifo()
    new_tuple = tuple.__new__  # Action(...) without the NamedTuple __new__ frame
    ops = [_COMPUTE_OP[d] for d in timeline.phases]
    computes = [new_tuple(Action, (op, s, b, None, None))  # by flat job index
                for s in range(table.stages) for b in range(table.micro) for op in ops]
    return programs_of(graph, table, build.programs(computes), ties)


def programs_of(graph: StageGraph, table: PlacementTable, ranks: Sequence[list[Action]],
                ties: Mapping[int, tuple[int, ...]] | None) -> Programs:
    """:class:`Programs` of ``ranks`` (a list, or lowered per rank: :mod:`.lazy_ranks`) with
    the facts the runtime needs beside them (owners, stage graph, ties)."""
    edges = [(u, v) for u in range(graph.num_stages) for v in graph.outputs(u)]
    return Programs(ranks, table.stages, table.micro, list(table.owners),
                    edges, forward_only=graph.forward_only,
                    split_backward=graph.split_backward, ties=dict(ties or {}))


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
    P = len(timeline.phases)
    BP = table.micro * P
    grad_k = timeline.phases.index(grad_phase) if grad_phase in timeline.phases else -1
    for worker, jobs in enumerate(timeline.order):
        owned = set(table.owned_stages(worker))
        if table.computed_stages(worker) <= owned:
            continue  # computes only stages it owns: nothing to fetch
        stages = [flat // BP for flat in jobs]
        freed_at: list[int] = []  # gap of the FREE_W of each fetched run so far
        for stage, i, j in stage_runs(stages, table.hold_fetched_for_step):
            if stage not in owned:
                fetch_gap = max(i - 1, 0)
                if fetch_window is not None and len(freed_at) >= fetch_window:
                    fetch_gap = max(fetch_gap, freed_at[-fetch_window])
                put_run(table, timeline, build, worker, stage, i, j, fetch_gap, grad_k,
                        reduce_gaps)
                freed_at.append(j + 1)
    return reduce_gaps


def stage_runs(stages: Sequence[int], whole_step: bool) -> list[tuple[int, int, int]]:
    """(stage, i, j) of every run of a worker's order (``stages``: each compute's stage): the
    span its weights stay resident, ordered by first compute.

    A run is a maximal block of consecutive computes of one stage; with ``whole_step`` (a
    sharded data-parallel placement: ``PlacementTable.hold_fetched_for_step``) it spans the
    stage's first compute of the step to its last, so a fetched stage is fetched once, kept
    across every microbatch and its gradient reduced once, whatever runs between.
    """
    runs: list[tuple[int, int, int]] = []
    if whole_step:
        span: dict[int, list[int]] = {}
        for index, stage in enumerate(stages):
            if stage in span:
                span[stage][1] = index
            else:
                span[stage] = [index, index]
        return [(stage, i, j) for stage, (i, j) in span.items()]  # first-seen order
    n, i = len(stages), 0
    while i < n:
        j = i
        while j + 1 < n and stages[j + 1] == stages[i]:
            j += 1
        runs.append((stages[i], i, j))
        i = j + 1
    return runs


def put_run(table: PlacementTable, timeline: Timeline, build: _Builder, worker: int,
            stage: int, i: int, j: int, fetch_gap: int, grad_k: int,
            reduce_gaps: dict[tuple[int, int], int]) -> None:
    """The actions of one fetched run: ``worker`` computes ``stage`` at positions i..j of its
    order; fetched at ``fetch_gap`` (see :func:`_lower_weights`). One function for the full
    lowering and the rank-local one (:mod:`.lower_rank`), so both put the same actions."""
    jobs = timeline.order[worker]
    P = len(timeline.phases)
    owner = table.fetch_source[(stage, worker)]
    prefetch_time = timeline.start[jobs[fetch_gap]] if i > 0 else 0.0
    build.put(worker, fetch_gap, prefetch_time, Action(Op.FETCH_W, stage, None, owner))
    build.put(owner, build.gap_at(owner, prefetch_time), prefetch_time,
              Action(Op.SEND_W, stage, None, worker))
    run_end = timeline.end[jobs[j]]
    BP = table.micro * P  # a whole-step run (stage_runs) holds other stages' computes too
    if any(jobs[k] % P == grad_k and jobs[k] // BP == stage for k in range(i, j + 1)):
        build.put(worker, j + 1, run_end, Action(Op.REDUCE_G, stage, None, owner))
        gap = build.gap_at(owner, run_end)
        build.put(owner, gap, run_end, Action(Op.RECV_G, stage, None, worker))
        key = (owner, stage)
        reduce_gaps[key] = max(reduce_gaps.get(key, 0), gap)
    build.put(worker, j + 1, run_end, Action(Op.FREE_W, stage))


def _lower_allreduce(
    table: PlacementTable,
    timeline: Timeline,
    build: _Builder,
    reduce_gaps: dict[tuple[int, int], int],
    grad_phase: Phase,
) -> None:
    """Replica owners all-reduce a stage right after their last weight-gradient job of it."""
    if all(len(owners) < 2 for owners in table.owners):
        return  # no replicas: nothing to all-reduce (and no need to scan every job)
    P = len(timeline.phases)
    BP = table.micro * P
    grad_k = timeline.phases.index(grad_phase)
    end = timeline.end
    last_backward: dict[tuple[int, int], tuple[int, float]] = {}
    for worker, jobs in enumerate(timeline.order):
        for i, flat in enumerate(jobs):
            if flat % P == grad_k:
                last_backward[(worker, flat // BP)] = (i + 1, end[flat])
    for stage, owners in enumerate(table.owners):
        if len(owners) < 2:
            continue
        group = RankGroup(owners)  # one object for all members: hashed once (see RankGroup)
        for owner in group:
            gap, time = last_backward.get((owner, stage), (0, 0.0))
            gap = max(gap, reduce_gaps.get((owner, stage), 0))
            build.put(owner, gap, time, Action(Op.ALLREDUCE_G, stage, None, None, group))
