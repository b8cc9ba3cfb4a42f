"""Prove a set of programs can run: every message matched, every input present, no deadlock.

The execution model is the runtime's: sends never block; a receive is posted where it appears
and completes once the peer's matching send has happened; a compute waits for the receives it
consumes; ``ALLREDUCE_G`` waits for the gradients posted to it and for every member of its
group. Each channel is FIFO per (src, dst): the k-th receive posted matches the k-th send.

Besides matching and deadlock, the dry run checks what the runtime relies on (per rank,
:mod:`.dryrun_rank`): inputs, stash, weights and ties resident, gradients leaving before a
free, nothing left at the end; collectives in the same order on every member of a group;
forward-only programs holding only forward ops and running every forward once. Any violation
raises :class:`ProgramError` naming the rank and the action in text form.

How: everything but waiting depends only on a rank's own earlier actions, so each program is
checked once in order, which also lists each channel's messages and yields the rank's sends and
waits; :func:`_walk` runs those alone for deadlock. Of several faults one is named: a static
one (matching, collective order, a peer that is no rank) first, else the first rank's.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import chain
from operator import itemgetter
from typing import Any

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.dryrun_rank import (
    Event,
    RankResult,
    Shared,
    channel_counters,
    check_forward_only,
    check_rank,
)
from lightning_gsched.schedule.program import (
    COLLECTIVE_OPS,
    OPS,
    RECV_FOR_SEND,
    SEND_OPS,
    Action,
    Channel,
    Message,
    Op,
    Programs,
    channel_bases,
    check_channel,
)

Orders = dict[tuple[int, ...], dict[int, list[tuple[Op, int, bool]]]]  # group -> rank -> ARs


def dry_run(programs: Programs) -> None:
    """Execute all programs symbolically; raise :class:`ProgramError` on any problem.

    Where a rank's check fails, the static checks run on their own first, so a mismatch is
    named rather than its symptom (a compute missing the input that was never received).
    """
    programs.ranks.make_all()  # reads every rank
    if programs.forward_only:
        for rank, program in enumerate(programs.ranks):
            check_forward_only(rank, program)
    shared = Shared(programs)
    try:
        results = [check_rank(shared, rank) for rank in range(programs.world_size)]
    except ProgramError:
        _check_static(programs)
        raise
    _check_matching(programs.world_size, shared.sent, shared.posted)
    _check_collective_order(shared.orders)
    stuck = _walk([result.events for result in results], shared.channels)
    if stuck:
        detail = "; ".join(f"rank {r} waits at '{programs.ranks[r][index]}'"
                           for r, index in stuck)
        raise ProgramError(f"programs deadlock: {detail}")
    _check_coverage(programs, results)


def _check_static(programs: Programs) -> None:
    """Matching and collective order from one pass over every action, trusting nothing a
    rank's check would have refused (a peer or microbatch that does not exist is named)."""
    W = programs.world_size
    base = channel_bases(W)
    sent: dict[int, list[Action]] = defaultdict(list)
    posted: dict[int, list[Action]] = defaultdict(list)
    orders: Orders = defaultdict(dict)
    bad_group: str | None = None
    micros = range(programs.num_micro)
    for rank, program in enumerate(programs.ranks):
        for action in program:
            op, peer = action[0], action[3]
            if op in base:  # a send or a receive
                per_micro = OPS[op].per_micro
                if peer not in range(W) or (per_micro and action[2] not in micros):
                    raise ProgramError(
                        f"rank {rank} runs '{action}': its peer must be a rank (0 to {W - 1})"
                        + (f" and its microbatch one of 0 to {programs.num_micro - 1}"
                           if per_micro else ""))
                if op in SEND_OPS:
                    sent[base[op] + rank * W + peer].append(action)
                else:
                    posted[base[op] + peer * W + rank].append(action)
            elif op in COLLECTIVE_OPS:
                group = action.group
                if group is None or rank not in group:
                    bad_group = bad_group or f"rank {rank} runs '{action}' but is not in its group"
                else:
                    orders[group].setdefault(rank, []).append((op, action.stage, action.tie))
    _check_matching(W, sent, posted)
    if bad_group is not None:
        raise ProgramError(bad_group)
    _check_collective_order(orders)


def _check_matching(W: int, sent: dict[int, list[Action]], posted: dict[int, list[Action]],
                    ) -> None:
    """:func:`.program.check_channel` on the messages listed per channel number: a quick
    comparison of every channel, then the rule itself on the first channel (in channel order)
    that differs, which names the message."""
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


def _check_collective_order(orders: Orders) -> None:
    """Members of one group must issue their all-reduces (stages' and ties') in the same order."""
    for group, by_rank in orders.items():
        reference = by_rank.get(group[0])
        for rank in group:
            if by_rank.get(rank) != reference:
                raise ProgramError(
                    f"ranks {group[0]} and {rank} all-reduce group {list(group)} in different "
                    f"orders: {reference} vs {by_rank.get(rank)}"
                )


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


def _check_coverage(programs: Programs, ranks: list[RankResult]) -> None:
    """Every (stage, microbatch) runs each of its phases exactly once across all ranks."""
    phases = ["F"] if programs.forward_only else ["B", "W"] if programs.split_backward else ["B"]
    M = programs.num_micro
    expected = set(range(programs.num_stages * M))  # jobs s * M + b
    for phase in phases:
        done_sets = [state.done[phase] for state in ranks]
        if sum(map(len, done_sets)) == len(expected) and set().union(*done_sets) == expected:
            continue  # each job once: as many runs as jobs, and every job among them
        count = Counter(chain.from_iterable(done_sets))
        for job in sorted(expected):
            if count[job] != 1:
                s, b = divmod(job, M)
                raise ProgramError(f"job {phase} s{s} b{b} runs {count[job]} times across "
                                   "ranks; expected once")
