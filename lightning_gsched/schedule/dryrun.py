"""Prove a set of programs can run: every message matched, every input present, no deadlock.

The execution model is the runtime's: sends never block; a receive is posted where it appears
and completes once the peer's matching send has happened (FIFO per channel); a compute waits for
the receives it consumes; ``ALLREDUCE_G`` for the gradients posted to it and every group member.

Also checked, as the runtime relies on it: inputs computed or posted before, stash, weights and
ties resident, gradients leaving before a free, nothing left at the end; collectives in one
order on every member of a group; forward-only programs holding only forward ops; every job run
once. A violation raises :class:`ProgramError` naming the rank and the action; of several, a
static one (matching, collective order, a peer that is no rank) first, else the first rank's.

How: all but waiting depends only on a rank's own earlier actions, and its state never changes
while it waits, so :func:`check_rank` walks each program once and yields what the interleaving
decides, the rank's **events**, which :func:`_walk` runs alone for deadlock: a send (its
channel); ``(index, messages)``, the compute at ``index`` consuming messages ``(channel, k)``,
each there once the channel counted k sends; ``(index, messages, key, size)``, an all-reduce
waiting for its messages, then for the ``size`` members of its group at ``key``. Channels
(:meth:`.program.Channel.number`) and jobs (``s * M + b``) are ints: cheap to hash.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import chain
from operator import itemgetter
from typing import Any, NamedTuple

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.consumption import OpRules
from lightning_gsched.schedule.program import (
    BACKWARD_OPS,
    CHANNEL_KINDS,
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

_Message = tuple[int, int]  # (channel id, k): the k-th message (counted from 1) on a channel
Event = Any  # int | tuple[int, list[_Message]] | tuple[int, list[_Message], tuple, int]
_ABSENT = object()  # a dict.get default that no stored value is
_DENSE_CHANNELS = 1 << 22  # channel ids counted in a list up to here (W up to about 1,180)
Orders = dict[tuple[int, ...], dict[int, list[tuple[Op, int, bool]]]]  # group -> rank -> ARs


def channel_counters(channels: int) -> list[int] | defaultdict[int, int]:
    """One 0 per channel id: a list while there are few, else a dict (W=4096 has 50 M ids, of
    which a plan uses a few per rank)."""
    return [0] * channels if channels <= _DENSE_CHANNELS else defaultdict(int)


def dry_run(programs: Programs) -> None:
    """Execute all programs symbolically; raise :class:`ProgramError` on any problem. Where a
    rank's check fails, the static checks run first, so a mismatch is named rather than its
    symptom (a compute missing the input that was never received)."""
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
        detail = "; ".join(f"rank {r} waits at '{programs.ranks[r][index]}'" for r, index in stuck)
        raise ProgramError(f"programs deadlock: {detail}")
    _check_coverage(programs, results)


def _check_static(programs: Programs) -> None:
    """Matching and collective order, trusting nothing a rank's check would have refused."""
    shared = Shared(programs)
    W, base, sent, posted, orders = shared.W, shared.base, shared.sent, shared.posted, shared.orders
    bad_group: str | None = None
    for rank, program in enumerate(programs.ranks):
        for action in program:
            op = action[0]
            if op in base:  # a send or a receive
                peer: int = action[3]  # type: ignore[assignment]  # checked next
                per_micro = OPS[op].per_micro
                if peer not in shared.peers or (per_micro and action[2] not in shared.micros):
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
    """:func:`.program.check_channel` on the first channel (in channel order) that differs."""
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
                raise ProgramError(f"ranks {group[0]} and {rank} all-reduce group {list(group)} in "
                                   f"different orders: {reference} vs {by_rank.get(rank)}")


class Shared:
    """What every rank's check shares, and the lists the static checks read once all are done."""

    def __init__(self, programs: Programs) -> None:
        self.programs, self.M = programs, programs.num_micro
        W = self.W = programs.world_size
        self.peers, self.micros = set(range(W)), set(range(self.M))
        self.rules = OpRules.of(programs)
        self.base = channel_bases(W)  # a channel's number: base[op] + src * W + dst
        self.channels = len(CHANNEL_KINDS) * W * W
        self.posted_count = channel_counters(self.channels)
        self.sent: dict[int, list[Action]] = defaultdict(list)  # per channel, in order
        self.posted: dict[int, list[Action]] = defaultdict(list)
        self.orders: Orders = defaultdict(dict)


class RankResult(NamedTuple):
    """One rank's events and, per phase ("F", "B", "W"), the jobs it ran (for coverage)."""

    events: list[Event]
    done: dict[str, set[int]]


def check_forward_only(rank: int, program: list[Action]) -> None:
    for index, action in enumerate(program):
        if action.op in BACKWARD_OPS:
            raise ProgramError(f"rank {rank} at action {index} ('{action}'): forward-only programs "
                               "contain only F, SEND_ACT/RECV_ACT and FETCH_W/SEND_W/FREE_W (of "
                               "stages and ties)")


def check_rank(shared: Shared, rank: int) -> RankResult:  # noqa: C901 - one loop, by op
    """Check ``rank``'s program in order; raise :class:`ProgramError` at the first problem."""
    programs, rules = shared.programs, shared.rules
    program = programs.ranks[rank]
    W, M, micros, peers, base = shared.W, shared.M, shared.micros, shared.peers, shared.base
    S = programs.num_stages
    inputs, outputs, ties_of = rules.act_from, rules.grad_from, rules.ties_read
    posted_count, sent_on, posted_on = shared.posted_count, shared.sent, shared.posted
    split, stash_op, weight_grad_op = programs.split_backward, rules.stash_op, rules.weight_grad_op

    def fail(index: int, message: str) -> ProgramError:
        where = f"'{program[index]}'" if index < len(program) else "the end"
        return ProgramError(f"rank {rank} at action {index} ({where}): {message}")

    # stage (tie home) -> None if owned, else the FETCH_W message its weights arrive with
    resident: dict[int, _Message | None] = {s: None for s in programs.owned_stages(rank)}
    tie_state: dict[int, _Message | None] = {h: None for h in programs.owned_ties(rank)}
    ran: dict[str, set[int]] = {"F": set(), "B": set(), "W": set()}  # phase -> jobs run
    forward_done, backward_done, weight_done = ran["F"], ran["B"], ran["W"]
    stash: set[int] = set()
    grad_stages: set[int] = set()  # stages whose weight gradients it accumulated
    tie_unreduced: set[int] = set()  # fetched ties holding gradients not yet sent
    # producer job -> the message its activation / input-gradient comes in
    posted_act: dict[int, _Message] = {}
    posted_grad: dict[int, _Message] = {}
    pending_grads: dict[tuple[int, bool], list[_Message]] = defaultdict(list)  # for ALLREDUCE_G
    events: list[Event] = []
    event = events.append
    # ops as locals (an ``Op.F`` look-up goes through the enum's descriptor)
    F, B, W_, SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD = (
        Op.F, Op.B, Op.W, Op.SEND_ACT, Op.SEND_GRAD, Op.RECV_ACT, Op.RECV_GRAD)
    FETCH_W, SEND_W, FREE_W, REDUCE_G, RECV_G = (
        Op.FETCH_W, Op.SEND_W, Op.FREE_W, Op.REDUCE_G, Op.RECV_G)
    for index, action in enumerate(program):
        op = action[0]
        if op is F or op is B or op is W_:
            s, b = action[1], action[2]
            weights = resident.get(s, _ABSENT)
            if weights is _ABSENT:
                raise fail(index, f"has no weights of stage {s}: it neither owns nor fetched them")
            if b not in micros:
                raise fail(index, f"names microbatch {b}; these programs have microbatches 0 "
                           f"to {M - 1}")
            job = s * M + b
            consumed: list[_Message] = [] if weights is None else [weights]  # type: ignore[list-item]
            ties = ties_of[s]
            for h in ties:
                if h not in tie_state:
                    raise fail(index, f"has no weights of tie {h} (read by stage {s}): it "
                               "neither owns nor fetched them")
                arrival = tie_state[h]
                if arrival is not None:
                    consumed.append(arrival)
            if op is F or op is B:  # reads its producers' outputs (consumers' gradients)
                if op is F:
                    done, sources, posted = forward_done, inputs, posted_act
                elif job not in stash:
                    raise fail(index, f"runs a backward without the stashed forward F s{s} b{b}")
                else:
                    done, sources, posted = backward_done, outputs, posted_grad
                if job in done:
                    raise fail(index, f"runs {op} s{s} b{b} twice")
                for other in sources[s]:
                    if other * M + b not in done:
                        message = posted.get(other * M + b)
                        if message is None:
                            what = "the output of F" if op is F else "the gradient from B"
                            raise fail(index, f"needs {what} s{other} b{b} but neither "
                                       "computed nor received it")
                        consumed.append(message)
                done.add(job)
                if op is stash_op:
                    stash.add(job)
            else:  # W: the weight-gradient half of a split backward, after its B on this rank
                if not split:
                    raise fail(index, "runs W, but these programs do not split the backward")
                if job not in backward_done or job not in stash:
                    raise fail(index, f"runs W s{s} b{b} before B s{s} b{b} on this rank")
                weight_done.add(job)
            if op is weight_grad_op:  # accumulates the weight gradients, ends the stash
                stash.discard(job)
                grad_stages.add(s)
                if ties:
                    tie_unreduced.update(h for h in ties if tie_state[h] is not None)
            if consumed:
                event((index, consumed))
            continue
        peer: int = action[3]  # type: ignore[assignment]
        if op is SEND_ACT or op is SEND_GRAD:
            if peer not in peers or action[2] not in micros:
                raise fail(index, "names a peer or microbatch these programs do not have")
            channel = base[op] + rank * W + peer
            sent_on[channel].append(action)
            event(channel)
            continue
        if op is RECV_ACT or op is RECV_GRAD:
            micro: int = action[2]  # type: ignore[assignment]
            if peer not in peers or micro not in micros:
                raise fail(index, "names a peer or microbatch these programs do not have")
            channel = base[op] + peer * W + rank
            k = posted_count[channel] + 1
            posted_count[channel] = k
            posted_on[channel].append(action)
            (posted_act if op is RECV_ACT else posted_grad)[action[1] * M + micro] = (channel, k)
            continue
        if op in base and peer not in peers:
            raise fail(index, "names a peer these programs do not have")
        s, tie = action[1], action[5]  # a weight unit's op: a stage's, or a tie's home's
        if not 0 <= s < S:
            raise fail(index, f"names {'tie' if tie else 'stage'} {s}; these programs have "
                       f"stages 0 to {S - 1}")
        if op is SEND_W or op is REDUCE_G:
            if op is REDUCE_G and not tie and s not in grad_stages:
                raise fail(index, f"sends the gradient of stage {s} but ran no "
                           f"{weight_grad_op} of it")
            if op is REDUCE_G and tie:
                if s not in tie_unreduced:
                    raise fail(index, f"sends the gradient of tie {s} but holds none (no "
                               f"{weight_grad_op} of a stage reading it ran since it was "
                               "fetched, or it was sent already)")
                tie_unreduced.discard(s)
            channel = base[op] + rank * W + peer
            sent_on[channel].append(action)
            event(channel)
        elif op is FETCH_W or op is RECV_G:
            channel = base[op] + peer * W + rank
            k = posted_count[channel] + 1
            posted_count[channel] = k
            posted_on[channel].append(action)
            if op is FETCH_W:
                held = tie_state if tie else resident
                if s in held:
                    raise fail(index, f"fetches {'tie' if tie else 'stage'} {s} whose weights "
                               "are already resident")
                held[s] = (channel, k)
            else:
                pending_grads[(s, tie)].append((channel, k))
        elif op is FREE_W:
            held = tie_state if tie else resident
            if held.get(s) is None:  # owned, or not held
                raise fail(index, f"frees {'tie' if tie else 'stage'} {s} which was not fetched")
            if tie and s in tie_unreduced:
                raise fail(index, f"frees tie {s} while its gradient was not sent to the owner "
                           f"(REDUCE_G t{s} must come first)")
            del held[s]
        else:  # ALLREDUCE_G
            group = action[4]
            if group is None or rank not in group:
                raise fail(index, "is an all-reduce of a group this rank is not in")
            shared.orders[group].setdefault(rank, []).append((op, s, tie))
            event((index, pending_grads.pop((s, tie), []), (group, s, tie), len(group)))
    end = len(program)
    if stash:
        stashed = sorted(divmod(job, M) for job in stash)
        raise fail(end, f"ends with stashed activations {stashed} that no backward consumed")
    for held, what in ((resident, "weights of stages"), (tie_state, "ties")):
        fetched = [unit for unit, message in held.items() if message is not None]
        if fetched:
            raise fail(end, f"ends with fetched {what} {fetched} never freed")
    # Gradients pending at the end are awaited by the owner before the optimizer step; the
    # matching check guarantees their sends exist and the walk that senders finish.
    return RankResult(events, ran)


def _walk(events: list[list[Event]], channels: int) -> list[tuple[int, int]]:
    """Run every rank through its events; return (rank, action index) of each rank left waiting
    (a deadlock). A waiting rank is parked under what it waits for and run again when that
    happens; as no rank passes an event that waits, the order ranks run in does not matter."""
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
                if event in waiters:
                    runnable += waiters.pop(event)
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
                elif event[2] in waiters:
                    runnable += waiters.pop(event[2])
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
