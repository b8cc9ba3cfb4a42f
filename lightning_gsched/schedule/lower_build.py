"""The lowering's builder: where each action goes in a program, and the FIFO order of posts.

One key system. A rank's program is its actions sorted by (gap, category, then the order they
were made in), gap g's actions coming right before the rank's compute g: hand data to peers
first, release memory, serve owners' duties, post the prefetches for the next computes
(:data:`CATEGORY`), the compute last (:data:`COMPUTE_CATEGORY`). Two families are made
differently and never share a category:

- the data flow (activation and input-gradient messages, :mod:`.lower_flow`, the planner's
  largest loop) appends actions with small int keys ``gap * SLOTS + category`` in the order
  they are made, which is already their order within a (gap, category);
- everything else (weights, reductions, all-reduces, ties: a few per run of a stage) goes
  through :meth:`Builder.put` with a full key (gap, category, time, serial): several owners'
  serves can land in one gap, ordered by the simulated time the peer needs them.

:meth:`Builder.program` sorts the second family by full key, then merges both families and the
computes by one stable sort of small ints.

One builder for every lowering. ``keep`` (None: every rank) names the ranks whose programs are
made; a put for another rank only takes its place in the order of serials, except a send into
a kept rank, which is filed under its channel for the receiver's FIFO fix. So the programs of
the kept ranks are exactly those of the lowering of every rank (only the relative order of
serials matters), whatever ranks are kept.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from operator import itemgetter
from typing import Any, Collection, Sequence, TypeVar

from lightning_gsched.schedule.program import (
    RECV_OPS,
    SEND_OPS,
    Action,
    Channel,
    Message,
    Op,
)
from lightning_gsched.schedule.simulate import Timeline

SLOTS = 9  # small key of an action: gap * SLOTS + category
SEND_CATEGORY, RECV_CATEGORY = 0, 7  # the data flow's: hand data over first, post inputs last
COMPUTE_CATEGORY = 8  # a compute closes its gap: after every category of it
CATEGORY = {
    Op.SEND_ACT: SEND_CATEGORY, Op.SEND_GRAD: SEND_CATEGORY, Op.REDUCE_G: 1, Op.FREE_W: 2,
    Op.SEND_W: 3, Op.RECV_G: 4, Op.ALLREDUCE_G: 5, Op.FETCH_W: 6,
    Op.RECV_ACT: RECV_CATEGORY, Op.RECV_GRAD: RECV_CATEGORY,
}

# (gap, category, time, serial), then (..., position) for a receive on a channel whose posts
# make_fifo had to reorder
Key = tuple[Any, ...]
P = TypeVar("P", int, Key)  # a post's place: a small int key (the data flow) or a full key


def fifo_places(posts_in_send_order: Sequence[P]) -> list[P]:
    """The FIFO rule, one place for both families of actions: a channel's receives, listed in
    the order of the sends they match, each take the earliest of its own post and the posts of
    every later send (a suffix minimum). So posts only ever move earlier, and a moved receive
    goes right before the receive it overtakes (its *anchor*), several movers of one anchor
    in their sends' order."""
    places: list[P] = list(posts_in_send_order)
    for k in range(len(places) - 2, -1, -1):
        if places[k + 1] < places[k]:
            places[k] = places[k + 1]
    return places


class Builder:
    """Collects actions per rank, then sorts each kept rank's into its program.

    ``entries[rank]``: (key, action) of what :meth:`put` receives. Sends into a kept rank and
    a kept rank's receives are also filed under their channel (``sends``, ``recvs``) for
    :meth:`make_fifo`. ``flow[rank]`` / ``flow_keys[rank]``: the data flow's actions and their
    small keys, filled by :func:`~.lower_flow.lower_data_flow` (for a subset of ranks it also
    holds the producers' sends into the kept ranks: :meth:`.lower.Lowering.program_and_sends`
    reads them).
    """

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
        # start times by worker, read when first needed (a rank-local lowering must not build
        # every worker's); by symmetry a rank's times are those of its position in replica 0
        self._starts = {} if starts is None else starts
        replicas = timeline.replicas
        self._time_key = replicas.position if replicas is not None else int

    def put(self, rank: int, gap: int, time: float, action: Action) -> None:
        self.serial += 1  # what is not kept still takes its place in the order of serials
        key = (gap, CATEGORY[action[0]], time, self.serial)
        keep = self.keep
        op = action.op
        kept = keep is None or rank in keep
        if kept:
            self.entries[rank].append((key, action))
        if op in SEND_OPS:
            assert action.peer is not None  # lowering names the peer of every message it emits
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
        """Post receives in each channel's send order by moving posts earlier where needed.

        For the actions of :meth:`put` (the data flow fixes its channels as they are made, by
        the same rule: :func:`fifo_places`). The k-th send of a message on a channel matches
        the k-th receive of that message (weights of one stage may be fetched several times);
        each matched receive's key becomes its place, then its send position breaks ties.
        """
        second = itemgetter(1)
        for channel, sent in self.sends.items():
            sent.sort()  # keys are unique: send order on the channel
            posts = sorted(self.recvs.get(channel, ()))  # post order
            if list(map(second, sent)) == list(map(second, posts)):
                continue  # the usual case: already in the same order, no post moves
            matched: list[int | None]
            if len(set(map(second, posts))) == len(posts):  # each message posted once
                index_of = {ident: index for _, ident, index in posts}
                matched = [index_of.pop(ident, None) for _, ident in sent]
            else:  # weights of one stage fetched several times: k-th send, k-th post
                waiting: dict[Message, list[int]] = defaultdict(list)
                for _, ident, index in reversed(posts):
                    waiting[ident].append(index)  # pop() yields the earliest post first
                matched = [waiting[ident].pop() if waiting[ident] else None
                           for _, ident in sent]
            entries = self.entries[channel.dst]
            # unmatched receives are left as they are on purpose: the dry run reports them
            kept = [(position, index) for position, index in enumerate(matched)
                    if index is not None]
            places = fifo_places([entries[index][0] for _, index in kept])
            for (position, index), key in zip(kept, places, strict=True):
                entries[index] = (key + (position,), entries[index][1])

    def program(self, rank: int, computes: list[Action]) -> list[Action]:
        """One rank's program: its ``computes`` (in its order) merged with its other actions.

        The put actions are sorted by their full keys first; from then on every action has a
        small int key (gap * SLOTS + category, a compute COMPUTE_CATEGORY in its own gap), and
        one stable sort of those ints keeps each family's order where keys are equal (equal keys
        are always of one family: the families never share a category).
        """
        first = itemgetter(0)
        entries = self.entries[rank]
        entries.sort(key=first)  # keys are unique (serial): a total order
        actions = self.flow[rank] + list(map(itemgetter(1), entries))
        actions += computes
        keys = self.flow_keys[rank] + [gap * SLOTS + category for gap, category, *_
                                       in map(first, entries)]
        keys += range(COMPUTE_CATEGORY, SLOTS * len(computes), SLOTS)
        return list(map(actions.__getitem__, sorted(range(len(keys)), key=keys.__getitem__)))
