"""Prove a set of programs can run: every message matched, every input present, no deadlock.

The execution model is the runtime's: sends never block; receives are posted where they appear
and complete when the peer's matching send has happened; a compute waits for the receives it
consumes; ``ALLREDUCE_G`` waits for the gradients posted to it and for every member of its group.
Each channel is FIFO per (src, dst): the k-th receive posted matches the k-th send.

The dry run also checks what the runtime relies on: a forward has all its inputs (computed here
or received), a backward has its stashed forward and its output gradients, a compute has its
stage's weights (owned, or fetched and not freed), collectives come in the same order on every
member of a group, and at the end nothing is stashed, fetched or unreceived. Any violation raises
:class:`ProgramError` naming the rank and the action in text form.

Ties (``programs.ties``) are weight units like stages (``FETCH_W t0 <-0``): a compute of a stage
that reads a tie needs the tie resident (owned, or fetched and not freed); a fetched tie's
gradient, once a weight-gradient job of a reader stage ran, must leave by its ``REDUCE_G`` before
its ``FREE_W``; its ``ALLREDUCE_G`` waits for its own ``RECV_G`` messages and every owner, and is
ordered with the stages' per group.

Split-backward programs (``programs.split_backward``, zero-bubble schedules) run ``W s b`` after
``B s b`` on the same rank; the stash lives until ``W``, and ``REDUCE_G`` needs a ``W`` of the stage.

Forward-only programs (``programs.forward_only``) may contain no backward-related action, stash
nothing (a forward's output is consumed by the next stage, not kept for a backward) and must
run every forward exactly once.

How: everything but waiting depends only on a rank's own earlier actions, so each program is
checked once in order (:mod:`.dryrun_rank`), which also lists each channel's messages for the
matching check and yields the rank's sends and waits; :func:`_walk` runs those alone for
deadlock. Programs with several faults get one of them named: a static one (matching,
collective order, a peer that is no rank) first, else the first found rank by rank.
"""

from __future__ import annotations

from collections import defaultdict
from operator import itemgetter
from typing import Any, NamedTuple

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.dryrun_rank import (
    Event,
    RankResult,
    Shared,
    channel_counters,
    check_rank,
)
from lightning_gsched.schedule.program import (
    BACKWARD_OPS,
    COLLECTIVE_OPS,
    OPS,
    RECV_FOR_SEND,
    RECV_OPS,
    SEND_OPS,
    Action,
    Channel,
    Message,
    Op,
    Programs,
    check_channel,
)


class _Scan(NamedTuple):
    """What one pass over every action collects for the static checks."""

    sent: dict[Channel, list[Message]]  # per channel, the messages in send order
    posted: dict[Channel, list[Message]]  # per channel, the messages in post order
    # group -> rank -> the all-reduces it runs, as (op, stage, tie): stages' and ties'
    orders: dict[tuple[int, ...], dict[int, list[tuple[Op, int, bool]]]]
    bad_group: str | None  # the first all-reduce run by a rank outside its group
    bad_field: str | None  # the first message whose peer or microbatch does not exist


def _scan(programs: Programs) -> _Scan:
    """One pass over every action (the static checks' only pass over all programs)."""
    sent: dict[Channel, list[Message]] = defaultdict(list)
    posted: dict[Channel, list[Message]] = defaultdict(list)
    orders: dict[tuple[int, ...], dict[int, list[tuple[Op, int, bool]]]] = defaultdict(dict)
    bad_group: str | None = None
    bad_field: str | None = None
    peers = set(range(programs.world_size))
    micros = set(range(programs.num_micro))
    for rank, program in enumerate(programs.ranks):
        for action in program:
            op = action[0]
            if op in SEND_OPS or op in RECV_OPS:
                # a malformed action may lack its peer or microbatch: reported, not assumed away
                if action[3] not in peers or (OPS[op].per_micro and action[2] not in micros):
                    bad_field = bad_field or (
                        f"rank {rank} runs '{action}': its peer must be a rank (0 to "
                        f"{programs.world_size - 1})" + (f" and its microbatch one of 0 to "
                                                         f"{programs.num_micro - 1}"
                                                         if OPS[op].per_micro else ""))
                    continue
                (sent if op in SEND_OPS else posted)[Channel.of(action, rank)].append(
                    Message.of(action))
            elif op in COLLECTIVE_OPS:
                group = action.group
                if group is None or rank not in group:
                    bad_group = bad_group or f"rank {rank} runs '{action}' but is not in its group"
                    continue
                orders[group].setdefault(rank, []).append((op, action.stage, action.tie))
    return _Scan(sent, posted, orders, bad_group, bad_field)


def check_matching(programs: Programs, scanned: _Scan | None = None) -> None:
    """Every send has a receive on its channel, in the same order, and vice versa
    (:func:`.program.check_channel`, channels in order)."""
    scanned = scanned or _scan(programs)
    if scanned.bad_field is not None:
        raise ProgramError(scanned.bad_field)
    sent, posted = scanned.sent, scanned.posted
    for channel in sorted(set(sent) | set(posted)):
        check_channel(channel, sent.get(channel, []), posted.get(channel, []))


def check_collective_order(programs: Programs, scanned: _Scan | None = None) -> None:
    """Members of one group must issue their all-reduces (stages' and ties') in the same order."""
    scanned = scanned or _scan(programs)
    if scanned.bad_group is not None:
        raise ProgramError(scanned.bad_group)
    orders = scanned.orders
    for group, by_rank in orders.items():
        reference = by_rank.get(group[0])
        for rank in group:
            if by_rank.get(rank) != reference:
                raise ProgramError(
                    f"ranks {group[0]} and {rank} all-reduce group {list(group)} in different "
                    f"orders: {reference} vs {by_rank.get(rank)}"
                )


def dry_run(programs: Programs) -> None:
    """Execute all programs symbolically; raise :class:`ProgramError` on any problem.

    In order: forward-only programs hold forward-only ops; every rank's program is checked in
    program order (:func:`~.dryrun_rank.check_rank`: weights, inputs, stash, gradients, the
    state at the end), which also lists every channel's messages and every group's
    all-reduces; those must match (same messages, same order) and agree; the ranks' events
    are walked for deadlock (:func:`_walk`); every job ran once. Where a rank's check fails,
    the static checks run on their own first, so a mismatch is named rather than its symptom
    (a compute missing the input that was never received).
    """
    programs.ranks.make_all()  # reads every rank
    if programs.forward_only:
        check_forward_only(programs)
    shared = Shared(programs)
    try:
        results = [check_rank(shared, rank) for rank in range(programs.world_size)]
    except ProgramError:
        scanned = _scan(programs)
        check_matching(programs, scanned)
        check_collective_order(programs, scanned)
        raise
    _check_listed_matching(programs, shared)
    check_collective_order(programs, _Scan({}, {}, shared.orders, None, None))
    stuck = _walk([result.events for result in results], shared.channels)
    if stuck:
        detail = "; ".join(f"rank {r} waits at '{programs.ranks[r][index]}'"
                           for r, index in stuck)
        raise ProgramError(f"programs deadlock: {detail}")
    _check_coverage(programs, results)


def _check_listed_matching(programs: Programs, shared: Shared) -> None:
    """:func:`.program.check_channel` on the messages the ranks' checks listed per channel
    number: a quick comparison of every channel, then the rule itself on the first channel (in
    channel order) that differs, which names the message."""
    W = programs.world_size
    sent, posted = shared.sent, shared.posted
    differing = [number for number in set(sent) | set(posted)
                 if not _same_messages(sent.get(number, []), posted.get(number, []))]
    if differing:
        number = min(differing, key=lambda n: Channel.numbered(n, W))
        check_channel(Channel.numbered(number, W),
                      [Message.of(action) for action in sent.get(number, ())],
                      [Message.of(action) for action in posted.get(number, ())])
        raise AssertionError(f"channel {number} differs but check_channel found nothing")


def _same_messages(sends: list[Action], posts: list[Action]) -> bool:
    """Whether sends and posts carry the same messages in order, without building them."""
    carried = itemgetter(1, 2, 5)  # stage, microbatch, tie
    return (len(sends) == len(posts)
            and list(map(carried, sends)) == list(map(carried, posts))
            and list(map(RECV_FOR_SEND.__getitem__, map(itemgetter(0), sends)))
            == list(map(itemgetter(0), posts)))


def _walk(events: list[list[Event]], channels: int) -> list[tuple[int, int]]:
    """Run every rank through its events; return (rank, action index) of each rank left
    waiting (a deadlock), else [].

    Sends never block; a consumer waits until each of its messages' channels counted enough
    sends; an all-reduce, then, until every member of its group reached it. A waiting rank is
    parked under what it waits for and run again when that happens; the result does not depend
    on the order ranks run in, since a rank never passes an event that waits.
    """
    sent = channel_counters(channels)
    position = [0] * len(events)
    waiters: dict[Any, list[int]] = {}
    arrived: dict[Any, set[int]] = defaultdict(set)
    runnable = list(range(len(events)))
    while runnable:
        rank = runnable.pop()
        mine = events[rank]
        i, end = position[rank], len(mine)
        while i < end:
            event = mine[i]
            if event.__class__ is int:  # a send
                sent[event] += 1
                woken = waiters.pop(event, None)
                if woken:
                    runnable += woken
                i += 1
                continue
            blocked: Any = None
            for channel, k in event[1]:
                if sent[channel] < k:
                    blocked = channel
                    break
            if blocked is None and len(event) == 4:  # an all-reduce: every member, then on
                members = arrived[event[2]]
                members.add(rank)
                if len(members) < event[3]:
                    blocked = event[2]
                else:
                    woken = waiters.pop(event[2], None)
                    if woken:
                        runnable += woken
            if blocked is not None:
                waiters.setdefault(blocked, []).append(rank)
                break
            i += 1
        position[rank] = i
    return [(rank, mine[position[rank]][0]) for rank, mine in enumerate(events)
            if position[rank] < len(mine)]


def check_forward_only(programs: Programs) -> None:
    """Forward-only programs contain no backward, input-gradient or gradient-reduction action."""
    for rank, program in enumerate(programs.ranks):
        for index, action in enumerate(program):
            if action.op in BACKWARD_OPS:
                raise ProgramError(
                    f"rank {rank} at action {index} ('{action}'): forward-only programs contain "
                    "only F, SEND_ACT/RECV_ACT and FETCH_W/SEND_W/FREE_W (of stages and ties)"
                )


def _check_coverage(programs: Programs, ranks: list[RankResult]) -> None:
    """Every (stage, microbatch) runs each of its phases exactly once across all ranks."""
    phases = ["F"] if programs.forward_only else ["B", "W"] if programs.split_backward else ["B"]
    M = programs.num_micro
    expected = set(range(programs.num_stages * M))  # jobs s * M + b
    for phase in phases:
        done_sets = [{"F": state.forward_done, "B": state.backward_done,
                      "W": state.weight_done}[phase] for state in ranks]
        if sum(map(len, done_sets)) == len(expected) and set().union(*done_sets) == expected:
            continue  # each job once: as many runs as jobs, and every job among them
        count: dict[int, int] = defaultdict(int)
        for done in done_sets:
            for job in done:
                count[job] += 1
        for job in sorted(expected):
            if count[job] != 1:
                s, b = divmod(job, M)
                raise ProgramError(f"job {phase} s{s} b{b} runs {count[job]} times across "
                                   "ranks; expected once")
