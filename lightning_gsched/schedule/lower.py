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
from typing import Any, Mapping

from lightning_gsched.schedule.jobs import Phase, StageGraph
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

# (gap, category, time, serial), then (..., position) for a receive on a channel whose posts
# make_fifo had to reorder; gap g's actions come right before compute g
_Key = tuple[Any, ...]
_Ident = tuple[int, "int | None", Op]  # (stage, micro, receive op): what a message carries
_Channel = tuple[str, int, int]  # (kind, src rank, dst rank)
_COMPUTE_OP = {Phase.F: Op.F, Phase.B: Op.B, Phase.W: Op.W}


class _Builder:
    """Collects actions per (rank, gap) with sort keys, then flattens them into programs.

    Every send and receive is also filed under its channel as it is put (so that
    :meth:`make_fifo` does not classify all actions again): ``sends[(kind, src, dst)]`` holds
    (key, identity) of each send, ``recvs[(kind, src, dst)]`` (key, identity, index in the
    receiver's entries) of each receive.
    """

    def __init__(self, timeline: Timeline) -> None:
        self.slots = timeline.by_worker
        self.starts = [[slot.start for slot in slots] for slots in self.slots]
        self.entries: list[list[tuple[_Key, Action]]] = [[] for _ in self.slots]
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

        The k-th send of a message identity on a channel matches the k-th receive of that
        identity (weights of one stage may be fetched several times). Walking the sends from last
        to first, each matched receive takes the smaller of its own key and the key of the
        receive after it, so posts only ever move earlier.
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
            if len(set(map(second, posts))) == len(posts):  # each message posted once (p2p)
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

    def programs(self) -> list[list[Action]]:
        """Flatten: gap g's actions (by category, time, serial) come right before compute g."""
        out = []
        new_tuple, compute_op, first = tuple.__new__, _COMPUTE_OP, itemgetter(0)
        for rank, entries in enumerate(self.entries):
            computes = [new_tuple(Action, (compute_op[d], s, b, None, None))
                        for s, b, d in map(first, self.slots[rank])]
            entries.sort(key=first)  # keys are unique (serial): a total order
            program: list[Action] = []
            append = program.append
            done = 0  # computes emitted so far
            for key, action in entries:
                gap = key[0]
                if done < gap:
                    program.extend(computes[done:gap])
                    done = gap
                append(action)
            program.extend(computes[done:])
            out.append(program)
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
    grad_phase = Phase.W if graph.split_backward else Phase.B  # accumulates weight gradients
    _lower_data_flow(graph, table, timeline, build)
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
    graph: StageGraph, table: PlacementTable, timeline: Timeline, build: _Builder
) -> None:
    """Activation sends/receives after forwards, input-gradient sends/receives after backwards.

    The planner's largest loop (two actions per message): jobs are found by flat index
    ``(stage * B + micro) * P + phase`` rather than by hashing, and each message is filed under
    its channel here, as :meth:`_Builder.put` would (same keys, same serials): every message
    this loop makes while visiting a consumer's slots is on a channel into that consumer, so
    they are gathered per sender and filed once per channel.
    """
    compute = table.compute
    B, P = table.micro, len(graph.phases)
    phase_index = {d: k for k, d in enumerate(graph.phases)}
    by_worker = timeline.by_worker
    position = [0] * (table.stages * B * P)  # flat job -> index in its worker's slots
    finished = [0.0] * (table.stages * B * P)  # flat job -> end time
    for slots in by_worker:
        for i, (job, _, _, end) in enumerate(slots):
            flat = (job[0] * B + job[1]) * P + phase_index[job[2]]
            position[flat] = i
            finished[flat] = end
    done: set[tuple[int, int, Phase, int]] = set()  # (producer stage, micro, phase, consumer)
    entries = build.entries
    new_tuple = tuple.__new__  # Action(...) without the NamedTuple __new__ frame
    serial = build.serial
    # per phase: (send op, its category, receive op, its category, channel, phase index)
    kinds = {
        phase: (send, _CATEGORY[send], recv, _CATEGORY[recv], CHANNEL_OF[send],
                phase_index[phase])
        for phase, send, recv in ((Phase.F, Op.SEND_ACT, Op.RECV_ACT),
                                  (Phase.B, Op.SEND_GRAD, Op.RECV_GRAD))
        if phase in phase_index
    }
    # W consumes nothing from another stage: it follows its own B
    sources = {d: [list(graph.inputs(s) if d is Phase.F else graph.outputs(s)
                        if d is Phase.B else []) for s in range(graph.num_stages)]
               for d in graph.phases}
    chain = graph.is_chain
    for worker, slots in enumerate(by_worker):
        mine = entries[worker]
        # channel -> src -> this consumer's sends / posts on channel src -> worker
        sent_here: dict[str, dict[int, list[tuple[_Key, _Ident]]]] = {
            kind[4]: defaultdict(list) for kind in kinds.values()}
        posted_here: dict[str, dict[int, list[tuple[_Key, _Ident, int]]]] = {
            kind[4]: defaultdict(list) for kind in kinds.values()}
        for i, (job, _, start, _) in enumerate(slots):
            s, b, phase = job
            others = sources[phase][s]
            if not others:
                continue
            send, send_cat, recv, recv_cat, channel, k = kinds[phase]
            sent_on, posted_on = sent_here[channel], posted_here[channel]
            gap = i - 1 if i else 0
            for other in others:
                src = compute[other][b]
                if src == worker:
                    continue
                if not chain:  # in a DAG one output may feed two stages on one worker
                    if (other, b, phase, worker) in done:
                        continue
                    done.add((other, b, phase, worker))
                flat = (other * B + b) * P + k
                ident = (other, b, recv)
                serial += 1
                key = (position[flat] + 1, send_cat, finished[flat], serial)
                entries[src].append((key, new_tuple(Action, (send, other, b, worker, None))))
                sent_on[src].append((key, ident))
                serial += 1
                key = (gap, recv_cat, start, serial)
                posted_on[src].append((key, ident, len(mine)))
                mine.append((key, new_tuple(Action, (recv, other, b, src, None))))
        for channel, by_src in sent_here.items():
            for src, sent in by_src.items():
                build.sends[(channel, src, worker)].extend(sent)
        for channel, by_src_posts in posted_here.items():
            for src, posted in by_src_posts.items():
                build.recvs[(channel, src, worker)].extend(posted)
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
        stages = [job[0] for job in map(itemgetter(0), slots)]
        owned = set(table.owned_stages(worker))
        if owned.issuperset(stages):
            continue  # computes only stages it owns: nothing to fetch
        freed_at: list[int] = []  # gap of the FREE_W of each fetched run so far
        n = len(stages)
        i = 0
        while i < n:
            stage = stages[i]
            j = i
            while j + 1 < n and stages[j + 1] == stage:
                j += 1
            if stage not in owned:
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
    if all(len(owners) < 2 for owners in table.owners):
        return  # no replicas: nothing to all-reduce (and no need to scan every slot)
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
