"""The lowering's data flow: activation and input-gradient messages, their posts in FIFO order.

The planner's largest loop (two actions per message), kept apart from :mod:`.lower`'s other
rules because it is built differently: its actions carry small int keys ``gap * SLOTS +
category`` (category 0 for a send, 7 for a receive) in the order they are made, which is their
order within a (gap, category), and its channel (``p2p``) carries nothing else, so the FIFO
order of every channel into a consumer is settled as soon as that consumer's receives are made.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from lightning_gsched.schedule.jobs import Phase, StageGraph
from lightning_gsched.schedule.lower_build import (
    RECV_CATEGORY,
    SEND_CATEGORY,
    SLOTS,
    fifo_places,
)
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import Action, Op
from lightning_gsched.schedule.simulate import Timeline


def lower_data_flow(graph: StageGraph, table: PlacementTable, timeline: Timeline,
                    flow: list[list[Action]], flow_keys: list[list[int]],
                    workers: Sequence[int] | None = None,
                    indexed: Sequence[int] | None = None) -> None:
    """Activation sends/receives after forwards, input-gradient sends/receives after backwards.

    The planner's largest loop (two actions per message). Consumers are visited worker by
    worker in their order; each remote input makes the producer's send (small key: the gap
    after the producer's compute, category 0) and the consumer's receive (the gap before the
    previous compute, category 7), both appended in the order the reference keys (serials)
    would give them. All messages into one consumer are made while visiting it, so its
    channels' FIFO order is settled right after (:func:`_fifo_posts`).

    ``workers`` (ascending): visit only these consumers, for a rank-local lowering
    (:class:`.lower.Lowering` of some ranks); ``indexed`` (default ``workers``) must hold them and every producer
    of their inputs (a group of a looped placement does), whose positions the sends are keyed
    by. A visited consumer's flow list then holds exactly what the full visit gives it, and
    a producer's holds, in the full visit's relative order, its sends to the visited consumers.
    """
    compute = table.compute
    B, P = table.micro, len(timeline.phases)
    BP = B * P
    phase_index = {d: k for k, d in enumerate(timeline.phases)}
    order = timeline.order
    visit = range(len(order)) if workers is None else workers
    # flat job -> index in its worker's order (a dict for a few workers: not one slot per job)
    position: list[int] | dict[int, int] = [0] * (table.stages * BP) if workers is None else {}
    for worker in (visit if indexed is None else indexed):
        for i, flat in enumerate(order[worker]):
            position[flat] = i
    done: set[tuple[int, int, int, int]] = set()  # (producer stage, micro, phase, consumer)
    new_tuple = tuple.__new__  # Action(...) without the NamedTuple __new__ frame
    # per phase index: (send op, receive op, the stages it receives from) -- W receives nothing
    kinds: list[tuple[Op, Op, list[list[int]]] | None] = [None] * P
    for phase, send, recv in ((Phase.F, Op.SEND_ACT, Op.RECV_ACT),
                              (Phase.B, Op.SEND_GRAD, Op.RECV_GRAD)):
        if phase in phase_index:
            kinds[phase_index[phase]] = (send, recv, [
                list(graph.inputs(s) if phase is Phase.F else graph.outputs(s))
                for s in range(graph.num_stages)])
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
    """Post one consumer's receives in each channel's send order (:func:`.lower_build.fifo_places`,
    the rule ``Builder.make_fifo`` applies too).

    A channel source -> consumer is in order when its producers' positions (the sends' order on
    the source: one send per producing compute) increase along its posts; the usual case. Else
    each receive takes its place (an index in ``mine``): a receive that moves goes right before
    its anchor and takes the anchor's key. ``mine[first_post:]`` holds this consumer's
    receives in post order; moves rewrite it.
    """
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
