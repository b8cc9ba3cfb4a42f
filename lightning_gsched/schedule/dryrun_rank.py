"""The dry run's per-rank half: one rank's program checked in order, and what it waits for.

Everything the dry run checks except waiting depends only on the rank's own program: a compute
has its stage's weights (owned, or fetched and not freed), its inputs (computed here before, or
posted here before), its stashed forward; a gradient leaves only after a weight-gradient job;
fetched weights and ties are freed; nothing is left stashed. A rank's state never changes
while it waits for another rank, so :func:`check_rank` walks each program once, in program
order, without waiting, and hands :mod:`.dryrun` the only things the ranks' interleaving
decides: its **events**, in order:

- ``channel`` (an int): a send on that channel;
- ``(index, messages)``: the action at ``index`` (a compute) consumes these messages, each
  ``(channel, k)``: the k-th message on the channel, there once the channel counted k sends;
- ``(index, messages, key, size)``: an all-reduce at ``index``: its gradient messages, then
  every one of the ``size`` members of its group at ``key``.

Channels are ints (``program.Channel.number``: ``kind * W * W + src * W + dst``), jobs (stage s, microbatch b) ints
``s * M + b``: every set and dict here hashes ints. A receive posts ``(channel, k)`` under what
it carries; the sends and receives of each channel are also listed (as actions) for the
matching check, and the all-reduces of each group for the order check.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.consumption import OpRules
from lightning_gsched.schedule.program import (
    CHANNEL_KINDS,
    Action,
    Op,
    Programs,
    channel_bases,
)

_Message = tuple[int, int]  # (channel id, k): the k-th message (counted from 1) on a channel
Event = Any  # int | tuple[int, list[_Message]] | tuple[int, list[_Message], tuple, int]
_ABSENT = object()  # a dict.get default that no stored value is
# Enum members as module constants (an ``Op.F`` look-up goes through the enum's descriptor)
_F, _B, _W = Op.F, Op.B, Op.W
_SEND_ACT, _SEND_GRAD, _RECV_ACT, _RECV_GRAD = Op.SEND_ACT, Op.SEND_GRAD, Op.RECV_ACT, Op.RECV_GRAD
_FETCH_W, _SEND_W, _FREE_W, _REDUCE_G = Op.FETCH_W, Op.SEND_W, Op.FREE_W, Op.REDUCE_G
_RECV_G, _ALLREDUCE_G = Op.RECV_G, Op.ALLREDUCE_G


_DENSE_CHANNELS = 1 << 22  # channel ids counted in a list up to here (W up to about 1,180)


def channel_counters(channels: int) -> list[int] | defaultdict[int, int]:
    """One count per channel id, all 0: a list while there are few ids, else a dict of the ones
    used (W=4096 has 50 M ids, of which a plan uses a few per rank)."""
    return [0] * channels if channels <= _DENSE_CHANNELS else defaultdict(int)


class Shared:
    """What every rank's check shares: sizes, the consumption rules (:class:`OpRules`: what a
    compute reads, what ends a stash), channel bases, and the lists the static checks read once
    every rank is done."""

    def __init__(self, programs: Programs) -> None:
        self.programs = programs
        W = self.W = programs.world_size
        self.M = programs.num_micro
        self.peers = set(range(W))
        self.micros = set(range(self.M))
        self.rules = OpRules.of(programs)
        self.base = channel_bases(W)  # a channel's number: base[op] + src * W + dst
        self.channels = len(CHANNEL_KINDS) * W * W
        self.posted_count = channel_counters(self.channels)
        self.sent: dict[int, list[Action]] = defaultdict(list)  # channel -> its sends, in order
        self.posted: dict[int, list[Action]] = defaultdict(list)  # channel -> its posts
        # group -> rank -> the all-reduces it runs, as (op, stage, tie)
        self.orders: dict[tuple[int, ...], dict[int, list[tuple[Op, int, bool]]]] = defaultdict(
            dict)


class RankResult:
    """One rank's events and the jobs it ran (for the coverage check)."""

    __slots__ = ("events", "forward_done", "backward_done", "weight_done")

    def __init__(self, events: list[Event], forward_done: set[int], backward_done: set[int],
                 weight_done: set[int]) -> None:
        self.events, self.forward_done = events, forward_done
        self.backward_done, self.weight_done = backward_done, weight_done


def check_rank(shared: Shared, rank: int) -> RankResult:  # noqa: C901 - one loop, by op
    """Check ``rank``'s program in order (see the module docstring); raise
    :class:`ProgramError` naming the rank and the action at the first problem."""
    programs = shared.programs
    program = programs.ranks[rank]
    W, M, micros, peers = shared.W, shared.M, shared.micros, shared.peers
    rules, base = shared.rules, shared.base
    # producers whose outputs F reads, consumers whose input-gradients B reads, ties per stage
    inputs, outputs, ties_of = rules.act_from, rules.grad_from, rules.ties_read
    posted_count, sent_on, posted_on = shared.posted_count, shared.sent, shared.posted
    split, stash_op, weight_grad_op = programs.split_backward, rules.stash_op, rules.weight_grad_op

    def fail(index: int, message: str) -> ProgramError:
        where = f"'{program[index]}'" if index < len(program) else "the end"
        return ProgramError(f"rank {rank} at action {index} ({where}): {message}")

    # stage -> None if owned, else the FETCH_W message its weights arrive with
    resident: dict[int, _Message | None] = {s: None for s in programs.owned_stages(rank)}
    # tie home -> the same, for the ties (a weight unit each, with ``action.tie`` set)
    tie_state: dict[int, _Message | None] = {h: None for h in programs.owned_ties(rank)}
    forward_done: set[int] = set()
    backward_done: set[int] = set()
    weight_done: set[int] = set()
    stash: set[int] = set()
    grad_stages: set[int] = set()  # stages whose weight gradients it accumulated
    tie_unreduced: set[int] = set()  # fetched ties holding gradients not yet sent
    # producer job -> the message its activation / input-gradient comes in
    posted_act: dict[int, _Message] = {}
    posted_grad: dict[int, _Message] = {}
    # (unit, tie) -> gradient messages posted for its all-reduce
    pending_grads: dict[tuple[int, bool], list[_Message]] = defaultdict(list)
    events: list[Event] = []
    event = events.append
    F, B, W_, SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD = (
        _F, _B, _W, _SEND_ACT, _SEND_GRAD, _RECV_ACT, _RECV_GRAD)
    for index, action in enumerate(program):
        op = action[0]
        if op is F or op is B or op is W_:
            s, b = action[1], action[2]
            weights = resident.get(s, _ABSENT)
            if weights is _ABSENT:
                raise fail(index, f"has no weights of stage {s}: it neither owns nor fetched "
                           "them")
            if b not in micros:
                raise fail(index, f"names microbatch {b}; these programs have microbatches 0 "
                           f"to {M - 1}")
            job = s * M + b
            consumed: list[_Message] = [] if weights is None else [weights]  # type: ignore[list-item]
            ties = ties_of[s]
            if ties:
                for h in ties:
                    if h not in tie_state:
                        raise fail(index, f"has no weights of tie {h} (read by stage {s}): it "
                                   "neither owns nor fetched them")
                    arrival = tie_state[h]
                    if arrival is not None:
                        consumed.append(arrival)
            if op is F:
                if job in forward_done:
                    raise fail(index, f"runs F s{s} b{b} twice")
                for other in inputs[s]:
                    if other * M + b not in forward_done:
                        message = posted_act.get(other * M + b)
                        if message is None:
                            raise fail(index, f"needs the output of F s{other} b{b} but "
                                       "neither computed nor received it")
                        consumed.append(message)
                forward_done.add(job)
                if op is stash_op:
                    stash.add(job)
            elif op is B:
                if job not in stash:
                    raise fail(index, f"runs a backward without the stashed forward F s{s} b{b}")
                if job in backward_done:
                    raise fail(index, f"runs B s{s} b{b} twice")
                for other in outputs[s]:
                    if other * M + b not in backward_done:
                        message = posted_grad.get(other * M + b)
                        if message is None:
                            raise fail(index, f"needs the gradient from B s{other} b{b} but "
                                       "neither computed nor received it")
                        consumed.append(message)
                backward_done.add(job)
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
        # a message's peer (and microbatch) must exist: ints from here on
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
        # a weight unit's op: a stage's, or a tie's (its home stage, action.tie)
        s, tie = action[1], action[5]
        if op is _SEND_W or op is _REDUCE_G:
            if op is _REDUCE_G and not tie and s not in grad_stages:
                raise fail(index, f"sends the gradient of stage {s} but ran no "
                           f"{weight_grad_op} of it")
            if op is _REDUCE_G and tie:
                if s not in tie_unreduced:
                    raise fail(index, f"sends the gradient of tie {s} but holds none (no "
                               f"{weight_grad_op} of a stage reading it ran since it was "
                               "fetched, or it was sent already)")
                tie_unreduced.discard(s)
            channel = base[op] + rank * W + peer
            sent_on[channel].append(action)
            event(channel)
        elif op is _FETCH_W or op is _RECV_G:
            channel = base[op] + peer * W + rank
            k = posted_count[channel] + 1
            posted_count[channel] = k
            posted_on[channel].append(action)
            if op is _FETCH_W:
                held = tie_state if tie else resident
                if s in held:
                    raise fail(index, f"fetches {'tie' if tie else 'stage'} {s} whose weights "
                               "are already resident")
                held[s] = (channel, k)
            else:
                pending_grads[(s, tie)].append((channel, k))
        elif op is _FREE_W:
            held = tie_state if tie else resident
            if held.get(s, _ABSENT) is None or s not in held:
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
    fetched = [s for s, msg in resident.items() if msg is not None]
    if fetched:
        raise fail(end, f"ends with fetched weights of stages {fetched} never freed")
    fetched = [h for h, msg in tie_state.items() if msg is not None]
    if fetched:
        raise fail(end, f"ends with fetched ties {fetched} never freed")
    # Gradients still pending at the end are awaited by the owner before the optimizer step;
    # the matching check guarantees their sends exist and the walk that senders finish.
    return RankResult(events, forward_done, backward_done, weight_done)
