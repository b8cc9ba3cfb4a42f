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

Forward-only programs (``programs.forward_only``) may contain no backward-related action, stash
nothing (a forward's output is consumed by the next stage, not kept for a backward) and must
run every forward exactly once.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from typing import Callable

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.program import (
    BACKWARD_OPS,
    CHANNEL_OF,
    RECV_FOR_SEND,
    RECV_OPS,
    SEND_OPS,
    Action,
    Op,
    Programs,
)

# A malformed action may lack its peer or microbatch: the types admit None so the dry run can
# report such programs instead of assuming them away.
_Channel = tuple[str, "int | None", "int | None"]  # (kind, src rank, dst rank)
_Message = tuple[_Channel, int]  # the k-th message (counted from 1) on a channel
_Ident = tuple[Op, int, "int | None"]  # (receive op, stage, micro): what a message carries
_Job = tuple[int, "int | None"]  # (stage, micro)
_CollectiveKey = tuple[tuple[int, ...], int]  # (group, stage) of an ALLREDUCE_G


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
    """Members of one group must issue their all-reduces in the same order."""
    orders: dict[tuple[int, ...], dict[int, list[int]]] = defaultdict(dict)
    for rank, program in enumerate(programs.ranks):
        for action in program:
            if action.op is Op.ALLREDUCE_G:
                group = action.group
                if group is None or rank not in group:
                    raise ProgramError(f"rank {rank} runs '{action}' but is not in its group")
                orders[group].setdefault(rank, []).append(action.stage)
    for group, by_rank in orders.items():
        reference = by_rank.get(group[0])
        for rank in group:
            if by_rank.get(rank) != reference:
                raise ProgramError(
                    f"ranks {group[0]} and {rank} all-reduce group {list(group)} in different "
                    f"orders: {reference} vs {by_rank.get(rank)}"
                )


class _Rank:
    __slots__ = ("pc", "posted", "pending_grads", "resident", "stash", "forward_done", "backward_done")

    def __init__(self, owned: set[int]) -> None:
        self.pc = 0
        self.posted: dict[_Ident, _Message] = {}  # (op, stage, micro) -> (channel, k)
        self.pending_grads: dict[int, list[_Message]] = defaultdict(list)
        # stage -> None if owned, else the FETCH_W message its weights arrive with
        self.resident: dict[int, _Message | None] = {s: None for s in owned}
        self.stash: set[_Job] = set()
        self.forward_done: set[_Job] = set()
        self.backward_done: set[_Job] = set()


def dry_run(programs: Programs) -> None:
    """Execute all programs symbolically; raise :class:`ProgramError` on any problem."""
    if programs.forward_only:
        check_forward_only(programs)
    check_matching(programs)
    check_collective_order(programs)
    inputs: dict[int, list[int]] = defaultdict(list)
    outputs: dict[int, list[int]] = defaultdict(list)
    for u, v in programs.edges:
        inputs[v].append(u)
        outputs[u].append(v)
    W = programs.world_size
    ranks = [_Rank(set(programs.owned_stages(r))) for r in range(W)]
    sent_count: dict[_Channel, int] = defaultdict(int)
    posted_count: dict[_Channel, int] = defaultdict(int)
    arrived: dict[_CollectiveKey, set[int]] = defaultdict(set)
    waiters: dict[_Channel | _CollectiveKey, set[int]] = defaultdict(set)
    runnable = deque(range(W))
    queued = set(range(W))

    def fail(rank: int, message: str) -> ProgramError:
        program = programs.ranks[rank]
        where = f"'{program[ranks[rank].pc]}'" if ranks[rank].pc < len(program) else "the end"
        return ProgramError(f"rank {rank} at action {ranks[rank].pc} ({where}): {message}")

    def ready(msg: _Message) -> bool:
        return sent_count[msg[0]] >= msg[1]

    def wait_for(rank: int, msgs: list[_Message]) -> bool:
        for msg in msgs:
            if not ready(msg):
                waiters[msg[0]].add(rank)
                return False
        return True

    def step(rank: int) -> bool:
        """Try to run the current action; return False if it must wait."""
        state, action = ranks[rank], programs.ranks[rank][ranks[rank].pc]
        op, s, b = action.op, action.stage, action.micro
        channel: _Channel
        if op in SEND_OPS:
            channel = (CHANNEL_OF[op], rank, action.peer)
            sent_count[channel] += 1
            for other in waiters.pop(channel, ()):
                if other not in queued:
                    queued.add(other)
                    runnable.append(other)
            if op is Op.REDUCE_G and not any(k[0] == s for k in state.backward_done):
                raise fail(rank, f"sends the gradient of stage {s} but ran no backward of it")
            return True
        if op in RECV_OPS:
            channel = (CHANNEL_OF[op], action.peer, rank)
            posted_count[channel] += 1
            msg: _Message = (channel, posted_count[channel])
            if op is Op.FETCH_W:
                if s in state.resident:
                    raise fail(rank, f"fetches stage {s} whose weights are already resident")
                state.resident[s] = msg
            elif op is Op.RECV_G:
                state.pending_grads[s].append(msg)
            else:
                state.posted[(op, s, b)] = msg
            return True
        if op is Op.FREE_W:
            if state.resident.get(s, "missing") in (None, "missing"):
                raise fail(rank, f"frees stage {s} which was not fetched")
            del state.resident[s]
            return True
        if op is Op.ALLREDUCE_G:
            if not wait_for(rank, state.pending_grads.get(s, [])):
                return False
            assert action.group is not None  # check_collective_order rejected a missing group
            key = (action.group, s)
            arrived[key].add(rank)
            if len(arrived[key]) < len(action.group):
                waiters[key].add(rank)
                return False
            for other in waiters.pop(key, ()):
                if other not in queued:
                    queued.add(other)
                    runnable.append(other)
            state.pending_grads.pop(s, None)
            return True
        # compute
        if s not in state.resident:
            raise fail(rank, f"has no weights of stage {s}: it neither owns nor fetched them")
        weights = state.resident[s]
        needed = [weights] if weights is not None else []
        if op is Op.F:
            if (s, b) in state.forward_done:
                raise fail(rank, f"runs F s{s} b{b} twice")
            deps = [(p, Op.RECV_ACT, f"the output of F s{p} b{b}")
                    for p in inputs[s] if (p, b) not in state.forward_done]
        else:
            if (s, b) not in state.stash:
                raise fail(rank, f"runs a backward without the stashed forward F s{s} b{b}")
            deps = [(c, Op.RECV_GRAD, f"the gradient from B s{c} b{b}")
                    for c in outputs[s] if (c, b) not in state.backward_done]
        for other, recv_op, what in deps:
            message = state.posted.get((recv_op, other, b))
            if message is None:
                raise fail(rank, f"needs {what} but neither computed nor received it")
            needed.append(message)
        if not wait_for(rank, needed):
            return False
        if op is Op.F:
            state.forward_done.add((s, b))
            if not programs.forward_only:
                state.stash.add((s, b))
        else:
            state.stash.discard((s, b))
            state.backward_done.add((s, b))
        return True

    while runnable:
        rank = runnable.popleft()
        queued.discard(rank)
        program = programs.ranks[rank]
        while ranks[rank].pc < len(program) and step(rank):
            ranks[rank].pc += 1
        if ranks[rank].pc == len(program):
            _check_end(rank, ranks[rank], fail)

    stuck = [r for r in range(W) if ranks[r].pc < len(programs.ranks[r])]
    if stuck:
        detail = "; ".join(f"rank {r} waits at '{programs.ranks[r][ranks[r].pc]}'" for r in stuck)
        raise ProgramError(f"programs deadlock: {detail}")
    _check_coverage(programs, ranks)


def _check_end(rank: int, state: _Rank, fail: Callable[[int, str], ProgramError]) -> None:
    if state.stash:
        raise fail(rank, f"ends with stashed activations {sorted(state.stash)} that no backward consumed")
    fetched = [s for s, msg in state.resident.items() if msg is not None]
    if fetched:
        raise fail(rank, f"ends with fetched weights of stages {fetched} never freed")
    # Gradients still pending at the end are awaited by the owner before the optimizer step;
    # check_matching guaranteed their sends exist and the stuck-rank check that senders finish.


def check_forward_only(programs: Programs) -> None:
    """Forward-only programs contain no backward, input-gradient or gradient-reduction action."""
    for rank, program in enumerate(programs.ranks):
        for index, action in enumerate(program):
            if action.op in BACKWARD_OPS:
                raise ProgramError(
                    f"rank {rank} at action {index} ('{action}'): forward-only programs contain "
                    "only F, SEND_ACT/RECV_ACT and FETCH_W/SEND_W/FREE_W"
                )


def _check_coverage(programs: Programs, ranks: list[_Rank]) -> None:
    count: dict[_Job, int] = defaultdict(int)
    for state in ranks:
        for key in state.forward_done if programs.forward_only else state.backward_done:
            count[key] += 1
    for s in range(programs.num_stages):
        for b in range(programs.num_micro):
            if count[(s, b)] != 1:
                raise ProgramError(f"job (s{s}, b{b}) runs {count[(s, b)]} times across ranks; expected once")
