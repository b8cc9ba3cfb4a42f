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
_Message = tuple[_Channel, int]  # the k-th message (counted from 1) on a channel
_Ident = tuple[Op, int, "int | None"]  # (receive op, stage, micro): what a message carries
_Job = tuple[int, "int | None"]  # (stage, micro)
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


def _scan(programs: Programs) -> _Scan:
    """One pass over every action (the static checks' only pass over all programs)."""
    sent: dict[_Channel, list[_Ident]] = defaultdict(list)
    posted: dict[_Channel, list[_Ident]] = defaultdict(list)
    orders: dict[tuple[int, ...], dict[int, list[tuple[Op, int]]]] = defaultdict(dict)
    bad_group: str | None = None
    # op -> (is a send, channel kind, the receive op that names the message)
    messages = {op: (op in SEND_OPS, CHANNEL_OF[op], RECV_FOR_SEND.get(op, op))
                for op in SEND_OPS | RECV_OPS}
    for rank, program in enumerate(programs.ranks):
        for action in program:
            op = action[0]
            kind = messages.get(op)
            if kind is not None:
                is_send, channel, recv_op = kind
                if is_send:
                    sent[(channel, rank, action[3])].append((recv_op, action[1], action[2]))
                else:
                    posted[(channel, action[3], rank)].append((op, action[1], action[2]))
            elif op in COLLECTIVE_OPS:
                group = action.group
                if group is None or rank not in group:
                    bad_group = bad_group or f"rank {rank} runs '{action}' but is not in its group"
                    continue
                orders[group].setdefault(rank, []).append((op, action.stage))
    return _Scan(sent, posted, orders, bad_group)


def check_matching(programs: Programs, scanned: _Scan | None = None) -> None:
    """Every send has a receive on its channel, in the same order, and vice versa."""
    sent, posted = (scanned or _scan(programs))[:2]
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
    __slots__ = ("posted", "pending_grads", "resident", "stash", "forward_done", "backward_done",
                 "weight_done", "grad_stages", "ties", "pending_tie_grads", "tie_unreduced")

    def __init__(self, owned: set[int], owned_ties: set[int]) -> None:
        self.posted: dict[_Ident, _Message] = {}  # (op, stage, micro) -> (channel, k)
        self.pending_grads: dict[int, list[_Message]] = defaultdict(list)
        # stage -> None if owned, else the FETCH_W message its weights arrive with
        self.resident: dict[int, _Message | None] = {s: None for s in owned}
        self.stash: set[_Job] = set()
        self.forward_done: set[_Job] = set()
        self.backward_done: set[_Job] = set()
        self.weight_done: set[_Job] = set()  # W of a split backward
        self.grad_stages: set[int] = set()  # stages whose weight gradients it accumulated
        # tie home -> None if owned, else the FETCH_T message its weights arrive with
        self.ties: dict[int, _Message | None] = {h: None for h in owned_ties}
        self.pending_tie_grads: dict[int, list[_Message]] = defaultdict(list)
        self.tie_unreduced: set[int] = set()  # fetched ties holding gradients not yet sent


class _DryRun:
    """Walk handler: the runtime's semantics, symbolically (see the module docstring)."""

    def __init__(self, programs: Programs, walker: Walker) -> None:
        self.programs = programs
        self.walker = walker
        self.split = programs.split_backward
        self.inputs: dict[int, list[int]] = defaultdict(list)
        self.outputs: dict[int, list[int]] = defaultdict(list)
        for u, v in programs.edges:
            self.inputs[v].append(u)
            self.outputs[u].append(v)
        self.ranks = [_Rank(set(programs.owned_stages(r)), set(programs.owned_ties(r)))
                      for r in range(programs.world_size)]
        self.ties_of = [programs.ties_read_by(s) for s in range(programs.num_stages)]
        self.sent_count: dict[_Channel, int] = defaultdict(int)
        self.posted_count: dict[_Channel, int] = defaultdict(int)
        self.arrived: dict[_CollectiveKey, set[int]] = defaultdict(set)

    def fail(self, rank: int, message: str) -> ProgramError:
        pc = self.walker.pc[rank]
        action = self.walker.current(rank)
        where = f"'{action}'" if action is not None else "the end"
        return ProgramError(f"rank {rank} at action {pc} ({where}): {message}")

    def _waiting(self, msgs: list[_Message]) -> _Channel | None:
        """The channel of the first message not sent yet (what to wait on), or None."""
        for channel, k in msgs:
            if self.sent_count[channel] < k:
                return channel
        return None

    def send(self, rank: int, action: Action) -> None:
        op = action[0]
        channel = (CHANNEL_OF[op], rank, action[3])
        self.sent_count[channel] += 1
        self.walker.wake(channel)
        if op is _REDUCE_G and action[1] not in self.ranks[rank].grad_stages:
            raise self.fail(rank, f"sends the gradient of stage {action.stage} but ran no "
                            f"{self.programs.weight_grad_op} of it")
        if op is _REDUCE_T:
            state = self.ranks[rank]
            if action.stage not in state.tie_unreduced:
                raise self.fail(rank, f"sends the gradient of tie {action.stage} but holds none "
                                f"(no {self.programs.weight_grad_op} of a stage reading it ran "
                                "since it was fetched, or it was sent already)")
            state.tie_unreduced.discard(action.stage)

    def recv(self, rank: int, action: Action) -> None:
        op, s = action[0], action[1]
        channel = (CHANNEL_OF[op], action[3], rank)
        posted_count = self.posted_count
        k = posted_count[channel] + 1
        posted_count[channel] = k
        msg: _Message = (channel, k)
        if op is _FETCH_W:
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
        elif op is _RECV_T:
            self.ranks[rank].pending_tie_grads[s].append(msg)
        else:
            self.ranks[rank].posted[(op, s, action[2])] = msg

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

    def collective(self, rank: int, action: Action) -> _Channel | _CollectiveKey | None:
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

    def compute(self, rank: int, action: Action) -> _Channel | None:
        # The planner's hottest check (one call per compute of every rank, again after each
        # wake): set look-ups on (stage, micro) and no message text unless something is wrong.
        state, op, s, b = self.ranks[rank], action[0], action[1], action[2]
        resident = state.resident
        if s not in resident:
            raise self.fail(rank, f"has no weights of stage {s}: it neither owns nor fetched them")
        weights = resident[s]
        job = (s, b)
        if op is _F:
            done = state.forward_done
            if job in done:
                raise self.fail(rank, f"runs F s{s} b{b} twice")
            others, recv_op = self.inputs[s], _RECV_ACT
        elif op is _B:
            if job not in state.stash:
                raise self.fail(rank, f"runs a backward without the stashed forward F s{s} b{b}")
            done = state.backward_done
            if job in done:
                raise self.fail(rank, f"runs B s{s} b{b} twice")
            others, recv_op = self.outputs[s], _RECV_GRAD
        else:  # W: the weight-gradient half of a split backward, after its B on this rank
            if not self.split:
                raise self.fail(rank, "runs W, but these programs do not split the backward")
            if job not in state.backward_done or job not in state.stash:
                raise self.fail(rank, f"runs W s{s} b{b} before B s{s} b{b} on this rank")
            done, others = state.weight_done, _NONE
        sent = self.sent_count
        # every input must be here or posted (else fail) before the first message not sent yet
        # (the weights', then the inputs' in order) is waited for
        wait: _Channel | None = None
        if weights is not None and sent[weights[0]] < weights[1]:
            wait = weights[0]
        ties = self.ties_of[s]
        if ties:
            for h in ties:
                if h not in state.ties:
                    raise self.fail(rank, f"has no weights of tie {h} (read by stage {s}): it "
                                    "neither owns nor fetched them")
                tie = state.ties[h]
                if wait is None and tie is not None and sent[tie[0]] < tie[1]:
                    wait = tie[0]
        for other in others:
            if (other, b) not in done:
                message = state.posted.get((recv_op, other, b))
                if message is None:
                    what = (f"the output of F s{other} b{b}" if op is _F
                            else f"the gradient from B s{other} b{b}")
                    raise self.fail(rank, f"needs {what} but neither computed nor received it")
                if wait is None and sent[message[0]] < message[1]:
                    wait = message[0]
        if wait is not None:
            return wait
        done.add(job)
        if op is _F:
            if not self.programs.forward_only:
                state.stash.add(job)
        elif op is _B:
            if not self.split:
                state.stash.discard(job)
                state.grad_stages.add(s)
        else:
            state.stash.discard(job)
            state.grad_stages.add(s)
        if ties and op is self.programs.weight_grad_op:
            state.tie_unreduced.update(h for h in ties if state.ties[h] is not None)
        return None


def dry_run(programs: Programs) -> None:
    """Execute all programs symbolically; raise :class:`ProgramError` on any problem."""
    if programs.forward_only:
        check_forward_only(programs)
    scanned = _scan(programs)
    check_matching(programs, scanned)
    check_collective_order(programs, scanned)
    walker = Walker(programs)
    handler = _DryRun(programs, walker)
    stuck = walker.run(handler, on_end=lambda rank: _check_end(
        rank, handler.ranks[rank], handler.fail))
    if stuck:
        detail = "; ".join(f"rank {r} waits at '{walker.current(r)}'" for r in stuck)
        raise ProgramError(f"programs deadlock: {detail}")
    _check_coverage(programs, handler.ranks)


def _check_end(rank: int, state: _Rank, fail: Callable[[int, str], ProgramError]) -> None:
    if state.stash:
        raise fail(rank, f"ends with stashed activations {sorted(state.stash)} that no backward consumed")
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
    expected = {(s, b) for s in range(programs.num_stages) for b in range(programs.num_micro)}
    for phase in phases:
        done_sets = [{"F": state.forward_done, "B": state.backward_done,
                      "W": state.weight_done}[phase] for state in ranks]
        if sum(map(len, done_sets)) == len(expected) and set().union(*done_sets) == expected:
            continue  # each job once: as many runs as jobs, and every job among them
        count: dict[_Job, int] = defaultdict(int)
        for state in ranks:
            done = {"F": state.forward_done, "B": state.backward_done, "W": state.weight_done}
            for key in done[phase]:
                count[key] += 1
        for s in range(programs.num_stages):
            for b in range(programs.num_micro):
                if count[(s, b)] != 1:
                    raise ProgramError(f"job {phase} s{s} b{b} runs {count[(s, b)]} times across "
                                       "ranks; expected once")
