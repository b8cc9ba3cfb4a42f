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
from typing import Callable

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


def check_matching(programs: Programs) -> None:
    """Every send has a receive on its channel, in the same order, and vice versa."""
    sent: dict[_Channel, list[tuple[_Ident, Action]]] = defaultdict(list)
    posted: dict[_Channel, list[tuple[_Ident, Action]]] = defaultdict(list)
    for rank, program in enumerate(programs.ranks):
        for action in program:
            ident: _Ident
            if action.op in SEND_OPS:
                ident = (RECV_FOR_SEND[action.op], action.stage, action.micro)
                sent[(CHANNEL_OF[action.op], rank, action.peer)].append((ident, action))
            elif action.op in RECV_OPS:
                ident = (action.op, action.stage, action.micro)
                posted[(CHANNEL_OF[action.op], action.peer, rank)].append((ident, action))
    for channel in sorted(set(sent) | set(posted), key=str):
        kind, src, dst = channel
        sends, recvs = sent.get(channel, []), posted.get(channel, [])
        if len(sends) == len(recvs) and all(s[0] == r[0] for s, r in zip(sends, recvs, strict=True)):
            continue  # the common case: same messages in the same order (nothing to report)
        unmatched = Counter(i for i, _ in sends)
        unmatched.subtract(i for i, _ in recvs)
        for ident, extra in unmatched.items():
            if extra > 0:
                action = next(a for i, a in sends if i == ident)
                raise ProgramError(f"rank {src} runs '{action}' but rank {dst} never receives it")
            if extra < 0:
                action = next(a for i, a in recvs if i == ident)
                raise ProgramError(f"rank {dst} posts '{action}' but rank {src} never sends it")
        for k in range(len(sends)):
            if sends[k][0] != recvs[k][0]:
                raise ProgramError(
                    f"{kind} channel {src}->{dst} is out of order at message {k}: rank {src} sends "
                    f"'{sends[k][1]}' but rank {dst} posts '{recvs[k][1]}'"
                )


def check_collective_order(programs: Programs) -> None:
    """Members of one group must issue their all-reduces (stages' and ties') in the same order."""
    orders: dict[tuple[int, ...], dict[int, list[str]]] = defaultdict(dict)
    for rank, program in enumerate(programs.ranks):
        for action in program:
            if action.op in COLLECTIVE_OPS:
                group = action.group
                if group is None or rank not in group:
                    raise ProgramError(f"rank {rank} runs '{action}' but is not in its group")
                orders[group].setdefault(rank, []).append(f"{action.op} s{action.stage}")
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
                 "weight_done", "ties", "pending_tie_grads", "tie_unreduced")

    def __init__(self, owned: set[int], owned_ties: set[int]) -> None:
        self.posted: dict[_Ident, _Message] = {}  # (op, stage, micro) -> (channel, k)
        self.pending_grads: dict[int, list[_Message]] = defaultdict(list)
        # stage -> None if owned, else the FETCH_W message its weights arrive with
        self.resident: dict[int, _Message | None] = {s: None for s in owned}
        self.stash: set[_Job] = set()
        self.forward_done: set[_Job] = set()
        self.backward_done: set[_Job] = set()
        self.weight_done: set[_Job] = set()  # W of a split backward
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
        self.ties_of = {s: programs.ties_read_by(s) for s in range(programs.num_stages)}
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
        channel = (CHANNEL_OF[action.op], rank, action.peer)
        self.sent_count[channel] += 1
        self.walker.wake(channel)
        if action.op is Op.REDUCE_G and not any(
                k[0] == action.stage for k in self._weight_grads_done(self.ranks[rank])):
            raise self.fail(rank, f"sends the gradient of stage {action.stage} but ran no "
                            f"{self.programs.weight_grad_op} of it")
        if action.op is Op.REDUCE_T:
            state = self.ranks[rank]
            if action.stage not in state.tie_unreduced:
                raise self.fail(rank, f"sends the gradient of tie {action.stage} but holds none "
                                f"(no {self.programs.weight_grad_op} of a stage reading it ran "
                                "since it was fetched, or it was sent already)")
            state.tie_unreduced.discard(action.stage)

    def _weight_grads_done(self, state: _Rank) -> set[_Job]:
        return state.weight_done if self.split else state.backward_done

    def recv(self, rank: int, action: Action) -> None:
        state, op, s = self.ranks[rank], action.op, action.stage
        channel = (CHANNEL_OF[op], action.peer, rank)
        self.posted_count[channel] += 1
        msg: _Message = (channel, self.posted_count[channel])
        if op is Op.FETCH_W:
            if s in state.resident:
                raise self.fail(rank, f"fetches stage {s} whose weights are already resident")
            state.resident[s] = msg
        elif op is Op.RECV_G:
            state.pending_grads[s].append(msg)
        elif op is Op.FETCH_T:
            if s in state.ties:
                raise self.fail(rank, f"fetches tie {s} whose weights are already resident")
            state.ties[s] = msg
        elif op is Op.RECV_T:
            state.pending_tie_grads[s].append(msg)
        else:
            state.posted[(op, s, action.micro)] = msg

    def free(self, rank: int, action: Action) -> None:
        state, s = self.ranks[rank], action.stage
        if action.op is Op.FREE_T:
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
        state, op, s, b = self.ranks[rank], action.op, action.stage, action.micro
        if s not in state.resident:
            raise self.fail(rank, f"has no weights of stage {s}: it neither owns nor fetched them")
        weights = state.resident[s]
        needed = [weights] if weights is not None else []
        for h in self.ties_of[s]:
            if h not in state.ties:
                raise self.fail(rank, f"has no weights of tie {h} (read by stage {s}): it neither "
                                "owns nor fetched them")
            tie = state.ties[h]
            if tie is not None:
                needed.append(tie)
        deps: list[tuple[int, Op, str]] = []
        if op is Op.F:
            if (s, b) in state.forward_done:
                raise self.fail(rank, f"runs F s{s} b{b} twice")
            deps = [(p, Op.RECV_ACT, f"the output of F s{p} b{b}")
                    for p in self.inputs[s] if (p, b) not in state.forward_done]
        elif op is Op.B:
            if (s, b) not in state.stash:
                raise self.fail(rank, f"runs a backward without the stashed forward F s{s} b{b}")
            if (s, b) in state.backward_done:
                raise self.fail(rank, f"runs B s{s} b{b} twice")
            deps = [(c, Op.RECV_GRAD, f"the gradient from B s{c} b{b}")
                    for c in self.outputs[s] if (c, b) not in state.backward_done]
        else:  # W: the weight-gradient half of a split backward, after its B on this rank
            if not self.split:
                raise self.fail(rank, "runs W, but these programs do not split the backward")
            if (s, b) not in state.backward_done or (s, b) not in state.stash:
                raise self.fail(rank, f"runs W s{s} b{b} before B s{s} b{b} on this rank")
        for other, recv_op, what in deps:
            message = state.posted.get((recv_op, other, b))
            if message is None:
                raise self.fail(rank, f"needs {what} but neither computed nor received it")
            needed.append(message)
        waiting = self._waiting(needed)
        if waiting is not None:
            return waiting
        if op is Op.F:
            state.forward_done.add((s, b))
            if not self.programs.forward_only:
                state.stash.add((s, b))
        elif op is Op.B:
            state.backward_done.add((s, b))
            if not self.split:
                state.stash.discard((s, b))
        else:
            state.weight_done.add((s, b))
            state.stash.discard((s, b))
        if op is self.programs.weight_grad_op:
            state.tie_unreduced.update(h for h in self.ties_of[s] if state.ties[h] is not None)
        return None


def dry_run(programs: Programs) -> None:
    """Execute all programs symbolically; raise :class:`ProgramError` on any problem."""
    if programs.forward_only:
        check_forward_only(programs)
    check_matching(programs)
    check_collective_order(programs)
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
    for phase in phases:
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
