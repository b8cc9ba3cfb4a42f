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

Ties (``programs.ties``): a compute of a stage that reads a tie needs the tie resident (owned, or
fetched by ``FETCH_T`` and not freed); a fetched tie's gradient, once a weight-gradient job of a
reader stage ran, must leave by ``REDUCE_T`` before its ``FREE_T``; ``ALLREDUCE_T`` waits like
``ALLREDUCE_G`` (its ``RECV_T`` messages, every owner) and is ordered with it per group.

Split-backward programs (``programs.split_backward``, zero-bubble schedules) run ``W s b`` after
``B s b`` on the same rank; the stash lives until ``W``, and ``REDUCE_G`` needs a ``W`` of the stage.

Forward-only programs (``programs.forward_only``) may contain no backward-related action, stash
nothing (a forward's output is consumed by the next stage, not kept for a backward) and must
run every forward exactly once.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Callable, NamedTuple

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.program import (
    BACKWARD_OPS,
    CHANNEL_OF,
    COLLECTIVE_OPS,
    OPS,
    RECV_FOR_SEND,
    RECV_OPS,
    SEND_OPS,
    Action,
    Op,
    Programs,
)
from lightning_gsched.schedule.walk import Walker

# A malformed action may lack its peer or microbatch: the types admit None so the dry run can
# report such programs instead of assuming them away.
_Channel = tuple[str, "int | None", "int | None"]  # (kind, src rank, dst rank)
_Message = tuple[int, int]  # (channel id, k): the k-th message (counted from 1) on a channel
_Ident = tuple[Op, int, "int | None"]  # (receive op, stage, micro): what a message carries
_CollectiveKey = tuple[tuple[int, ...], Op, int]  # (group, op, stage) of an all-reduce
# Enum members as module constants: ``Op.F`` is a class attribute look-up through the enum's
# descriptor (about 0.2 us on Python 3.11), paid several times per action in the walk
_F, _B, _RECV_ACT, _RECV_GRAD = Op.F, Op.B, Op.RECV_ACT, Op.RECV_GRAD
_FETCH_W, _RECV_G, _REDUCE_G, _ALLREDUCE_G = Op.FETCH_W, Op.RECV_G, Op.REDUCE_G, Op.ALLREDUCE_G
_FETCH_T, _RECV_T, _REDUCE_T, _FREE_T = Op.FETCH_T, Op.RECV_T, Op.REDUCE_T, Op.FREE_T
_NONE: list[int] = []  # no inputs (never appended to)


class _Scan(NamedTuple):
    """What one pass over every action collects for the static checks."""

    sent: dict[_Channel, list[_Ident]]  # per channel, the messages in send order
    posted: dict[_Channel, list[_Ident]]  # per channel, the messages in post order
    # group -> rank -> the all-reduces it runs, as (op, stage): stages' and ties'
    orders: dict[tuple[int, ...], dict[int, list[tuple[Op, int]]]]
    bad_group: str | None  # the first all-reduce run by a rank outside its group
    bad_field: str | None  # the first message whose peer or microbatch does not exist


def _scan(programs: Programs) -> _Scan:
    """One pass over every action (the static checks' only pass over all programs)."""
    sent: dict[_Channel, list[_Ident]] = defaultdict(list)
    posted: dict[_Channel, list[_Ident]] = defaultdict(list)
    orders: dict[tuple[int, ...], dict[int, list[tuple[Op, int]]]] = defaultdict(dict)
    bad_group: str | None = None
    bad_field: str | None = None
    peers = set(range(programs.world_size))
    micros = set(range(programs.num_micro))
    # op -> (is a send, channel kind, the receive op that names the message, names a micro)
    messages = {op: (op in SEND_OPS, CHANNEL_OF[op], RECV_FOR_SEND.get(op, op), OPS[op].per_micro)
                for op in SEND_OPS | RECV_OPS}
    for rank, program in enumerate(programs.ranks):
        for action in program:
            op = action[0]
            kind = messages.get(op)
            if kind is not None:
                is_send, channel, recv_op, per_micro = kind
                peer = action[3]
                if peer not in peers or (per_micro and action[2] not in micros):
                    bad_field = bad_field or (
                        f"rank {rank} runs '{action}': its peer must be a rank (0 to "
                        f"{programs.world_size - 1})" + (f" and its microbatch one of 0 to "
                                                         f"{programs.num_micro - 1}"
                                                         if per_micro else ""))
                    continue
                if is_send:
                    sent[(channel, rank, peer)].append((recv_op, action[1], action[2]))
                else:
                    posted[(channel, peer, rank)].append((op, action[1], action[2]))
            elif op in COLLECTIVE_OPS:
                group = action.group
                if group is None or rank not in group:
                    bad_group = bad_group or f"rank {rank} runs '{action}' but is not in its group"
                    continue
                orders[group].setdefault(rank, []).append((op, action.stage))
    return _Scan(sent, posted, orders, bad_group, bad_field)


def check_matching(programs: Programs, scanned: _Scan | None = None) -> None:
    """Every send has a receive on its channel, in the same order, and vice versa."""
    scanned = scanned or _scan(programs)
    if scanned.bad_field is not None:
        raise ProgramError(scanned.bad_field)
    sent, posted = scanned.sent, scanned.posted
    for channel in sorted(set(sent) | set(posted), key=str):
        sends, recvs = sent.get(channel, []), posted.get(channel, [])
        if sends == recvs:
            continue  # the common case: same messages in the same order (nothing to report)
        _report_mismatch(programs, channel, sends, recvs)


def _report_mismatch(programs: Programs, channel: _Channel, sends: list[_Ident],
                     recvs: list[_Ident]) -> None:
    """Raise the :class:`ProgramError` that names the first unmatched or misordered message."""
    kind, src, dst = channel

    def actions(rank: int | None, ops: frozenset[Op], peer: int | None) -> list[Action]:
        program = programs.ranks[rank] if rank is not None else []
        return [a for a in program if a.op in ops and CHANNEL_OF[a.op] == kind and a.peer == peer]

    send_actions = actions(src, SEND_OPS, dst)
    recv_actions = actions(dst, RECV_OPS, src)
    unmatched = Counter(sends)
    unmatched.subtract(recvs)
    for ident, extra in unmatched.items():
        if extra > 0:
            action = send_actions[sends.index(ident)]
            raise ProgramError(f"rank {src} runs '{action}' but rank {dst} never receives it")
        if extra < 0:
            action = recv_actions[recvs.index(ident)]
            raise ProgramError(f"rank {dst} posts '{action}' but rank {src} never sends it")
    for k in range(len(sends)):
        if sends[k] != recvs[k]:
            raise ProgramError(
                f"{kind} channel {src}->{dst} is out of order at message {k}: rank {src} sends "
                f"'{send_actions[k]}' but rank {dst} posts '{recv_actions[k]}'"
            )


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


class _Rank:
    """One rank's state in the walk. A job (stage s, microbatch b) is the int ``s * M + b``
    (M microbatches; the scan checked every message's microbatch, computes check theirs), so
    the sets and dicts below hash ints, not tuples."""

    __slots__ = ("posted_act", "posted_grad", "pending_grads", "resident", "stash",
                 "forward_done", "backward_done", "weight_done", "grad_stages", "ties",
                 "pending_tie_grads", "tie_unreduced")

    def __init__(self, owned: set[int], owned_ties: set[int]) -> None:
        # producer job -> the message (channel id, k) its activation / input-gradient comes in
        self.posted_act: dict[int, _Message] = {}
        self.posted_grad: dict[int, _Message] = {}
        self.pending_grads: dict[int, list[_Message]] = defaultdict(list)
        # stage -> None if owned, else the FETCH_W message its weights arrive with
        self.resident: dict[int, _Message | None] = {s: None for s in owned}
        self.stash: set[int] = set()
        self.forward_done: set[int] = set()
        self.backward_done: set[int] = set()
        self.weight_done: set[int] = set()  # W of a split backward
        self.grad_stages: set[int] = set()  # stages whose weight gradients it accumulated
        # tie home -> None if owned, else the FETCH_T message its weights arrive with
        self.ties: dict[int, _Message | None] = {h: None for h in owned_ties}
        self.pending_tie_grads: dict[int, list[_Message]] = defaultdict(list)
        self.tie_unreduced: set[int] = set()  # fetched ties holding gradients not yet sent


_ABSENT = object()  # a dict.get default that no stored value equals
_CHANNEL_KINDS = {kind: index for index, kind in enumerate(dict.fromkeys(CHANNEL_OF.values()))}


class _DryRun:
    """Walk handler: the runtime's semantics, symbolically (see the module docstring).

    Channels are ints ``kind * W * W + src * W + dst`` (the scan checked every peer is a rank)
    and a message is (channel, k): the k-th on its channel, which has arrived once the channel
    counted k sends. A compute that has to wait for a message is remembered with the messages
    it waits for (its rank's state cannot change meanwhile), so when the walker runs it again
    only those are looked at.
    """

    def __init__(self, programs: Programs, walker: Walker) -> None:
        self.programs = programs
        self.walker = walker
        self.split = programs.split_backward
        self.forward_only = programs.forward_only
        self.weight_grad_op = programs.weight_grad_op
        W, self.M = programs.world_size, programs.num_micro
        self.W = W
        self.micros = set(range(self.M))
        self.inputs: dict[int, list[int]] = defaultdict(list)
        self.outputs: dict[int, list[int]] = defaultdict(list)
        for u, v in programs.edges:
            self.inputs[v].append(u)
            self.outputs[u].append(v)
        self.ranks = [_Rank(set(programs.owned_stages(r)), set(programs.owned_ties(r)))
                      for r in range(W)]
        self.ties_of = [programs.ties_read_by(s) for s in range(programs.num_stages)]
        # op -> the id of its channel kind's block (channel = base + src * W + dst)
        self.base = {op: _CHANNEL_KINDS[kind] * W * W for op, kind in CHANNEL_OF.items()}
        self.sent_count = [0] * (len(_CHANNEL_KINDS) * W * W)
        self.posted_count = [0] * (len(_CHANNEL_KINDS) * W * W)
        self.arrived: dict[_CollectiveKey, set[int]] = defaultdict(set)
        # rank -> (the compute it waits at, the messages that compute consumes), else None
        self.waiting: list[tuple[Action, list[_Message]] | None] = [None] * W

    def fail(self, rank: int, message: str) -> ProgramError:
        pc = self.walker.pc[rank]
        action = self.walker.current(rank)
        where = f"'{action}'" if action is not None else "the end"
        return ProgramError(f"rank {rank} at action {pc} ({where}): {message}")

    def _waiting(self, msgs: list[_Message]) -> int | None:
        """The channel of the first message not sent yet (what to wait on), or None."""
        sent = self.sent_count
        for channel, k in msgs:
            if sent[channel] < k:
                return channel
        return None

    def send(self, rank: int, action: Action) -> None:
        op = action[0]
        peer: int = action[3]  # type: ignore[assignment]  # the scan checked every peer
        channel = self.base[op] + rank * self.W + peer
        self.sent_count[channel] += 1
        self.walker.wake(channel)
        if op is _REDUCE_G and action[1] not in self.ranks[rank].grad_stages:
            raise self.fail(rank, f"sends the gradient of stage {action.stage} but ran no "
                            f"{self.weight_grad_op} of it")
        if op is _REDUCE_T:
            state = self.ranks[rank]
            if action.stage not in state.tie_unreduced:
                raise self.fail(rank, f"sends the gradient of tie {action.stage} but holds none "
                                f"(no {self.weight_grad_op} of a stage reading it ran "
                                "since it was fetched, or it was sent already)")
            state.tie_unreduced.discard(action.stage)

    def recv(self, rank: int, action: Action) -> None:
        op, s = action[0], action[1]
        peer: int = action[3]  # type: ignore[assignment]  # the scan checked every peer
        channel = self.base[op] + peer * self.W + rank
        posted_count = self.posted_count
        k = posted_count[channel] + 1
        posted_count[channel] = k
        msg: _Message = (channel, k)
        if op is _RECV_ACT:  # the scan checked their microbatches
            self.ranks[rank].posted_act[s * self.M + action[2]] = msg  # type: ignore[operator]
        elif op is _RECV_GRAD:
            self.ranks[rank].posted_grad[s * self.M + action[2]] = msg  # type: ignore[operator]
        elif op is _FETCH_W:
            state = self.ranks[rank]
            if s in state.resident:
                raise self.fail(rank, f"fetches stage {s} whose weights are already resident")
            state.resident[s] = msg
        elif op is _RECV_G:
            self.ranks[rank].pending_grads[s].append(msg)
        elif op is _FETCH_T:
            state = self.ranks[rank]
            if s in state.ties:
                raise self.fail(rank, f"fetches tie {s} whose weights are already resident")
            state.ties[s] = msg
        else:  # RECV_T
            self.ranks[rank].pending_tie_grads[s].append(msg)

    def free(self, rank: int, action: Action) -> None:
        state, s = self.ranks[rank], action.stage
        if action.op is _FREE_T:
            if state.ties.get(s, "missing") in (None, "missing"):
                raise self.fail(rank, f"frees tie {s} which was not fetched")
            if s in state.tie_unreduced:
                raise self.fail(rank, f"frees tie {s} while its gradient was not sent to the "
                                "owner (REDUCE_T must come first)")
            del state.ties[s]
            return
        if state.resident.get(s, "missing") in (None, "missing"):
            raise self.fail(rank, f"frees stage {s} which was not fetched")
        del state.resident[s]

    def collective(self, rank: int, action: Action) -> int | _CollectiveKey | None:
        state, s = self.ranks[rank], action.stage
        pending = state.pending_tie_grads if action.op is Op.ALLREDUCE_T else state.pending_grads
        waiting = self._waiting(pending.get(s, []))
        if waiting is not None:
            return waiting
        assert action.group is not None  # check_collective_order rejected a missing group
        key = (action.group, action.op, s)
        self.arrived[key].add(rank)
        if len(self.arrived[key]) < len(action.group):
            return key
        self.walker.wake(key)
        pending.pop(s, None)
        return None

    def compute(self, rank: int, action: Action) -> int | None:
        # The planner's hottest check (one call per compute of every rank): int jobs, set
        # look-ups, no message text unless something is wrong.
        waited = self.waiting[rank]
        if waited is not None and waited[0] is action:  # checked already: only its messages
            sent = self.sent_count
            for channel, k in waited[1]:
                if sent[channel] < k:
                    return channel
            self.waiting[rank] = None
            self._done(self.ranks[rank], action)
            return None
        state, op, s, b = self.ranks[rank], action[0], action[1], action[2]
        weights = state.resident.get(s, _ABSENT)
        if weights is _ABSENT:
            raise self.fail(rank, f"has no weights of stage {s}: it neither owns nor fetched them")
        if b not in self.micros:
            raise self.fail(rank, f"names microbatch {b}; these programs have microbatches 0 to "
                            f"{self.M - 1}")
        M = self.M
        job = s * M + b
        if op is _F:
            if job in state.forward_done:
                raise self.fail(rank, f"runs F s{s} b{b} twice")
            done, others, posted = state.forward_done, self.inputs[s], state.posted_act
        elif op is _B:
            if job not in state.stash:
                raise self.fail(rank, f"runs a backward without the stashed forward F s{s} b{b}")
            if job in state.backward_done:
                raise self.fail(rank, f"runs B s{s} b{b} twice")
            done, others, posted = state.backward_done, self.outputs[s], state.posted_grad
        else:  # W: the weight-gradient half of a split backward, after its B on this rank
            if not self.split:
                raise self.fail(rank, "runs W, but these programs do not split the backward")
            if job not in state.backward_done or job not in state.stash:
                raise self.fail(rank, f"runs W s{s} b{b} before B s{s} b{b} on this rank")
            done, others, posted = state.weight_done, _NONE, state.posted_act
        # every input must be here or posted (else fail) before any message is waited for
        consumed: list[_Message] = []  # the weights', the ties', then the inputs' in order
        if weights is not None:
            consumed.append(weights)  # type: ignore[arg-type]  # not _ABSENT: checked above
        ties = self.ties_of[s]
        if ties:
            for h in ties:
                if h not in state.ties:
                    raise self.fail(rank, f"has no weights of tie {h} (read by stage {s}): it "
                                    "neither owns nor fetched them")
                tie = state.ties[h]
                if tie is not None:
                    consumed.append(tie)
        for other in others:
            if other * M + b not in done:
                message = posted.get(other * M + b)
                if message is None:
                    what = (f"the output of F s{other} b{b}" if op is _F
                            else f"the gradient from B s{other} b{b}")
                    raise self.fail(rank, f"needs {what} but neither computed nor received it")
                consumed.append(message)
        if consumed:
            sent = self.sent_count
            for channel, k in consumed:
                if sent[channel] < k:
                    self.waiting[rank] = (action, consumed)
                    return channel
        self._done(state, action)
        return None

    def _done(self, state: _Rank, action: Action) -> None:
        """A compute ran: record it, and what it stashed, released or accumulated."""
        op, s = action[0], action[1]
        job = s * self.M + action[2]  # type: ignore[operator]  # compute() checked it
        if op is _F:
            state.forward_done.add(job)
            if not self.forward_only:
                state.stash.add(job)
        elif op is _B:
            state.backward_done.add(job)
            if not self.split:
                state.stash.discard(job)
                state.grad_stages.add(s)
        else:
            state.weight_done.add(job)
            state.stash.discard(job)
            state.grad_stages.add(s)
        ties = self.ties_of[s]
        if ties and op is self.weight_grad_op:
            state.tie_unreduced.update(h for h in ties if state.ties[h] is not None)


def dry_run(programs: Programs) -> None:
    """Execute all programs symbolically; raise :class:`ProgramError` on any problem."""
    if programs.forward_only:
        check_forward_only(programs)
    scanned = _scan(programs)
    check_matching(programs, scanned)
    check_collective_order(programs, scanned)
    walker = Walker(programs)
    handler = _DryRun(programs, walker)
    M = programs.num_micro
    stuck = walker.run(handler, on_end=lambda rank: _check_end(
        rank, handler.ranks[rank], M, handler.fail))
    if stuck:
        detail = "; ".join(f"rank {r} waits at '{walker.current(r)}'" for r in stuck)
        raise ProgramError(f"programs deadlock: {detail}")
    _check_coverage(programs, handler.ranks)


def _check_end(rank: int, state: _Rank, micro: int,
               fail: Callable[[int, str], ProgramError]) -> None:
    if state.stash:
        stashed = sorted(divmod(job, micro) for job in state.stash)
        raise fail(rank, f"ends with stashed activations {stashed} that no backward consumed")
    fetched = [s for s, msg in state.resident.items() if msg is not None]
    if fetched:
        raise fail(rank, f"ends with fetched weights of stages {fetched} never freed")
    ties = [h for h, msg in state.ties.items() if msg is not None]
    if ties:
        raise fail(rank, f"ends with fetched ties {ties} never freed")
    # Gradients still pending at the end are awaited by the owner before the optimizer step;
    # check_matching guaranteed their sends exist and the stuck-rank check that senders finish.


def check_forward_only(programs: Programs) -> None:
    """Forward-only programs contain no backward, input-gradient or gradient-reduction action."""
    for rank, program in enumerate(programs.ranks):
        for index, action in enumerate(program):
            if action.op in BACKWARD_OPS:
                raise ProgramError(
                    f"rank {rank} at action {index} ('{action}'): forward-only programs contain "
                    "only F, SEND_ACT/RECV_ACT, FETCH_W/SEND_W/FREE_W and FETCH_T/SEND_T/FREE_T"
                )


def _check_coverage(programs: Programs, ranks: list[_Rank]) -> None:
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
