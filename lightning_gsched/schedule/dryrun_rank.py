"""The dry run's per-rank half: one rank's program checked in order, and what it waits for.

Everything but waiting depends only on the rank's own program (weights resident, inputs computed
or posted before, stash, gradients, the state at the end), and a rank's state never changes
while it waits, so :func:`check_rank` walks a program once, without waiting, and hands
:mod:`.dryrun` the only things the interleaving decides, its **events** in order:

- ``channel`` (an int): a send on that channel;
- ``(index, messages)``: the compute at ``index`` consumes these messages, each ``(channel,
  k)``: the k-th message on the channel, there once the channel counted k sends;
- ``(index, messages, key, size)``: an all-reduce at ``index``: its gradient messages, then
  every one of the ``size`` members of its group at ``key``.

Channels are ints (:meth:`.program.Channel.number`), jobs (s, b) ints ``s * M + b``: every set
and dict here hashes ints. Each channel's sends and posts are also listed (as actions) for the
matching check, and each group's all-reduces for the order check.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.consumption import OpRules
from lightning_gsched.schedule.program import (
    BACKWARD_OPS,
    CHANNEL_KINDS,
    Action,
    Op,
    Programs,
    channel_bases,
)

_Message = tuple[int, int]  # (channel id, k): the k-th message (counted from 1) on a channel
Event = Any  # int | tuple[int, list[_Message]] | tuple[int, list[_Message], tuple, int]
_ABSENT = object()  # a dict.get default that no stored value is
_DENSE_CHANNELS = 1 << 22  # channel ids counted in a list up to here (W up to about 1,180)


def channel_counters(channels: int) -> list[int] | defaultdict[int, int]:
    """One count per channel id, all 0: a list while there are few ids, else a dict of the ones
    used (W=4096 has 50 M ids, of which a plan uses a few per rank)."""
    return [0] * channels if channels <= _DENSE_CHANNELS else defaultdict(int)


class Shared:
    """What every rank's check shares: sizes, the consumption rules, channel bases, and the
    lists the static checks read once every rank is done."""

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


class RankResult(NamedTuple):
    """One rank's events and, per phase ("F", "B", "W"), the jobs it ran (for coverage)."""

    events: list[Event]
    done: dict[str, set[int]]


def check_forward_only(rank: int, program: list[Action]) -> None:
    """Forward-only programs contain no backward, input-gradient or gradient-reduction action."""
    for index, action in enumerate(program):
        if action.op in BACKWARD_OPS:
            raise ProgramError(
                f"rank {rank} at action {index} ('{action}'): forward-only programs contain "
                "only F, SEND_ACT/RECV_ACT and FETCH_W/SEND_W/FREE_W (of stages and ties)"
            )


def check_rank(shared: Shared, rank: int) -> RankResult:  # noqa: C901 - one loop, by op
    """Check ``rank``'s program in order; raise :class:`ProgramError` naming the rank and the
    action at the first problem."""
    programs = shared.programs
    program = programs.ranks[rank]
    W, M, micros, peers, base = shared.W, shared.M, shared.micros, shared.peers, shared.base
    rules = shared.rules
    inputs, outputs, ties_of = rules.act_from, rules.grad_from, rules.ties_read
    posted_count, sent_on, posted_on = shared.posted_count, shared.sent, shared.posted
    split, stash_op, weight_grad_op = programs.split_backward, rules.stash_op, rules.weight_grad_op

    def fail(index: int, message: str) -> ProgramError:
        where = f"'{program[index]}'" if index < len(program) else "the end"
        return ProgramError(f"rank {rank} at action {index} ({where}): {message}")

    # stage (tie home) -> None if owned, else the FETCH_W message its weights arrive with
    resident: dict[int, _Message | None] = {s: None for s in programs.owned_stages(rank)}
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
                raise fail(index, f"has no weights of stage {s}: it neither owns nor fetched "
                           "them")
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
    # Gradients pending at the end are awaited by the owner before the optimizer step; the
    # matching check guarantees their sends exist and the walk that senders finish.
    return RankResult(events, {"F": forward_done, "B": backward_done, "W": weight_done})
