"""The lowering's builder: where each action goes in a program, the FIFO order of posts, and
the data flow (activation and input-gradient messages).

A rank's program is its actions sorted by (gap, category, then the order they were made in), gap
g's actions coming right before the rank's compute g: hand data to peers first, release memory,
serve owners' duties, post the prefetches for the next computes (:data:`CATEGORY`), the compute
last. Two families never share a category: the data flow (:func:`lower_data_flow`, the
planner's largest loop) appends actions with small int keys (``gap * SLOTS + category``) in the
order they are made, their order within a (gap, category), on channels that carry nothing else;
the rest (a few actions per run of a stage) goes through :meth:`Builder.put` with a full key
(gap, category, time, serial): several owners' serves can land in one gap, ordered by the
simulated time the peer needs them. ``keep`` (None: every rank) names the ranks whose programs
are made; a put for another rank only takes its place in the order of serials, except a send
into a kept rank, which is filed for the receiver's FIFO fix (why that suffices: :mod:`.lower`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from operator import itemgetter
from typing import Any, Collection, Sequence, TypeVar

from lightning_gsched.schedule.consumption import OpRules
from lightning_gsched.schedule.jobs import Phase, StageGraph
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import RECV_OPS, SEND_OPS, Action, Channel, Message, Op
from lightning_gsched.schedule.simulate import Timeline

SLOTS = 9  # small key of an action: gap * SLOTS + category
SEND_CATEGORY, RECV_CATEGORY = 0, 7  # the data flow's: hand data over first, post inputs last
COMPUTE_CATEGORY = 8  # a compute closes its gap: after every category of it
CATEGORY = {
    Op.SEND_ACT: SEND_CATEGORY, Op.SEND_GRAD: SEND_CATEGORY, Op.REDUCE_G: 1, Op.FREE_W: 2,
    Op.SEND_W: 3, Op.RECV_G: 4, Op.ALLREDUCE_G: 5, Op.FETCH_W: 6,
    Op.RECV_ACT: RECV_CATEGORY, Op.RECV_GRAD: RECV_CATEGORY,
}

# (gap, category, time, serial), then (..., position) for a receive make_fifo moved
Key = tuple[Any, ...]
Place = TypeVar("Place", int, Key)  # a post's place: a small int key (data flow) or a full key


def fifo_places(posts_in_send_order: Sequence[Place]) -> list[Place]:
    """The FIFO rule: a channel's receives, in the order of the sends they match, each take the
    earliest of its own post and those of every later send. So posts only move earlier, each
    right before the receive it overtakes (its *anchor*), movers of one anchor in send order."""
    places: list[Place] = list(posts_in_send_order)
    for k in range(len(places) - 2, -1, -1):
        if places[k + 1] < places[k]:
            places[k] = places[k + 1]
    return places


class Builder:
    """Collects actions per rank, then sorts each kept rank's into its program. ``entries``:
    (key, action) of each :meth:`put`, sends into a kept rank and a kept rank's receives filed
    per channel too (``sends``, ``recvs``); ``flow``, ``flow_keys``: the data flow's."""

    def __init__(self, timeline: Timeline, keep: Collection[int] | None = None,
                 starts: dict[int, list[float]] | None = None) -> None:
        W = len(timeline.order)
        self.timeline, self.keep = timeline, keep
        self.entries: list[list[tuple[Key, Action]]] = [[] for _ in range(W)]
        self.flow: list[list[Action]] = [[] for _ in range(W)]
        self.flow_keys: list[list[int]] = [[] for _ in range(W)]
        self.serial = 0
        self.sends: dict[Channel, list[tuple[Key, Message]]] = defaultdict(list)
        self.recvs: dict[Channel, list[tuple[Key, Message, int]]] = defaultdict(list)
        # start times per worker (by symmetry, per replica position), made when first needed
        self._starts = {} if starts is None else starts
        replicas = timeline.replicas
        self._time_key = replicas.position if replicas is not None else int

    def put(self, rank: int, gap: int, time: float, action: Action) -> None:
        self.serial += 1  # what is not kept still takes its place in the order of serials
        keep, op = self.keep, action[0]
        key = (gap, CATEGORY[op], time, self.serial)
        kept = keep is None or rank in keep
        if kept:
            self.entries[rank].append((key, action))
        if op in SEND_OPS:
            if keep is None or action.peer in keep:  # orders the receiver's posts
                self.sends[Channel.of(action, rank)].append((key, Message.of(action)))
        elif op in RECV_OPS and kept:
            self.recvs[Channel.of(action, rank)].append(
                (key, Message.of(action), len(self.entries[rank]) - 1))

    def gap_at(self, rank: int, time: float) -> int:
        """Gap before the first compute on ``rank`` that starts at or after ``time``."""
        key = self._time_key(rank)
        starts = self._starts.get(key)
        if starts is None:
            start = self.timeline.start
            starts = self._starts[key] = [start[j] for j in self.timeline.order[rank]]
        return bisect.bisect_left(starts, time)

    def make_fifo(self) -> None:
        """Post the receives of :meth:`put` in each channel's send order (:func:`fifo_places`):
        the k-th send of a message matches its k-th receive (a stage's weights may be fetched
        several times); a matched receive's key becomes its place, its send position next."""
        second = itemgetter(1)
        for channel, sent in self.sends.items():
            sent.sort()  # keys are unique: send order on the channel
            posts = sorted(self.recvs.get(channel, ()))  # post order
            if list(map(second, sent)) == list(map(second, posts)):
                continue  # the usual case: already in the same order, no post moves
            waiting: dict[Message, list[int]] = defaultdict(list)  # k-th send, k-th post
            for _, ident, index in reversed(posts):
                waiting[ident].append(index)  # pop() yields the earliest post first
            matched = [waiting[ident].pop() if waiting[ident] else None for _, ident in sent]
            entries = self.entries[channel.dst]
            # unmatched receives are left as they are on purpose: the dry run reports them
            kept = [(place, index) for place, index in enumerate(matched) if index is not None]
            places = fifo_places([entries[index][0] for _, index in kept])
            for (position, index), key in zip(kept, places, strict=True):
                entries[index] = (key + (position,), entries[index][1])

    def program(self, rank: int, computes: list[Action]) -> list[Action]:
        """One rank's program: its ``computes`` merged with its other actions. The put actions
        are sorted by their full keys first; then one stable sort of small int keys keeps each
        family's order where keys are equal (equal keys are always of one family)."""
        first = itemgetter(0)
        entries = self.entries[rank]
        entries.sort(key=first)  # keys are unique (serial): a total order
        actions = self.flow[rank] + list(map(itemgetter(1), entries)) + computes
        keys = self.flow_keys[rank] + [key[0] * SLOTS + key[1] for key, _ in entries]
        keys += range(COMPUTE_CATEGORY, SLOTS * len(computes), SLOTS)
        return list(map(actions.__getitem__, sorted(range(len(keys)), key=keys.__getitem__)))


def lower_data_flow(graph: StageGraph, rules: OpRules, table: PlacementTable, build: Builder,
                    workers: Sequence[int] | None, indexed: Sequence[int] | None) -> None:
    """The activation and input-gradient messages, into ``build.flow``. Consumers are visited
    worker by worker in their order; each remote input makes the producer's send (the gap after
    the producer's compute) and the consumer's receive (the gap before the previous compute),
    both appended in the order serials would give them; all messages into one consumer are made
    while visiting it, so its FIFO order is settled right after (:func:`_fifo_posts`).
    ``workers`` (ascending): visit only these consumers; ``indexed`` (default ``workers``) must
    hold them and every producer of their inputs, whose positions key the sends. A visited
    consumer's flow is then the full visit's, and a producer's holds its sends to it in order.
    """
    timeline, flow, flow_keys, compute = build.timeline, build.flow, build.flow_keys, table.compute
    B, P, order = table.micro, len(timeline.phases), timeline.order
    BP = B * P
    visit = range(len(order)) if workers is None else workers
    # flat job -> index in its worker's order (a dict for a few workers: not one slot per job)
    position: list[int] | dict[int, int] = [0] * (table.stages * BP) if workers is None else {}
    for worker in (visit if indexed is None else indexed):
        for i, flat in enumerate(order[worker]):
            position[flat] = i
    done: set[tuple[int, int, int, int]] = set()  # (producer stage, micro, phase, consumer)
    new_tuple = tuple.__new__  # Action(...) without the NamedTuple __new__ frame
    # per phase index: (send op, receive op, the stages it receives from) -- W receives nothing
    flows = {Phase.F: (Op.SEND_ACT, Op.RECV_ACT, rules.act_from),
             Phase.B: (Op.SEND_GRAD, Op.RECV_GRAD, rules.grad_from)}
    kinds = [flows.get(phase) for phase in timeline.phases]
    chain = graph.is_chain
    for worker in visit:
        jobs = order[worker]
        mine, my_keys = flow[worker], flow_keys[worker]
        first_post = len(mine)
        # per source rank: the producers' positions and the receives' indices in ``mine``, in
        # post order (the channel source -> worker)
        positions: defaultdict[int, list[int]] = defaultdict(list)
        posts: defaultdict[int, list[int]] = defaultdict(list)
        for i, flat in enumerate(jobs):
            k = flat % P
            kind = kinds[k]
            if kind is None:
                continue
            s = flat // BP
            others = kind[2][s]
            if not others:
                continue
            b = (flat - s * BP) // P
            send, recv = kind[0], kind[1]
            recv_key = (i - 1 if i else 0) * SLOTS + RECV_CATEGORY
            for other in others:
                src = compute[other][b]
                if src == worker:
                    continue
                if not chain:  # in a DAG one output may feed two stages on one worker
                    if (other, b, k, worker) in done:
                        continue
                    done.add((other, b, k, worker))
                produced = position[(other * B + b) * P + k]
                flow[src].append(new_tuple(Action, (send, other, b, worker, None, False)))
                flow_keys[src].append(produced * SLOTS + SLOTS + SEND_CATEGORY)
                positions[src].append(produced)
                posts[src].append(len(mine))
                mine.append(new_tuple(Action, (recv, other, b, src, None, False)))
                my_keys.append(recv_key)
        _fifo_posts(mine, my_keys, first_post, positions, posts)


def _fifo_posts(mine: list[Action], keys: list[int], first_post: int,
                positions: dict[int, list[int]], posts: dict[int, list[int]]) -> None:
    """Post one consumer's receives (``mine[first_post:]``, rewritten) in each channel's send
    order (:func:`fifo_places`). A channel is in order when its producers' positions increase
    along its posts, the usual case; else a mover goes right before its anchor, with its key."""
    movers: dict[int, list[tuple[int, int]]] = {}  # anchor index -> (send position, mover)
    moved: set[int] = set()
    for source, source_positions in positions.items():
        if source_positions == sorted(source_positions):
            continue
        source_posts = posts[source]
        send_order = sorted(range(len(source_positions)), key=source_positions.__getitem__)
        in_send_order = [source_posts[post] for post in send_order]
        for place, (post, anchor) in enumerate(zip(in_send_order, fifo_places(in_send_order),
                                                   strict=True)):
            if anchor != post:
                movers.setdefault(anchor, []).append((place, post))
                moved.add(post)
    if not moved:
        return
    actions: list[Action] = []
    small: list[int] = []
    for index in range(first_post, len(mine)):
        if index in moved:
            continue
        key = keys[index]
        for _, mover in sorted(movers.get(index, ())):
            actions.append(mine[mover])
            small.append(key)
        actions.append(mine[index])
        small.append(key)
    mine[first_post:] = actions
    keys[first_post:] = small
