"""The program IR: one ordered list of actions per rank, which the planner costs and draws and
the runtime executes. What each op means is written once, in :data:`OPS`; what each action
consumes and releases, in :mod:`.consumption`. An action's text form (``F s3 b1``, ``SEND_ACT s3
b1 ->2``, ``FETCH_W t0 <-0``, ``ALLREDUCE_G s5 [0,2]``) round-trips through :meth:`Action.parse`.
Receives are *posts*: the runtime starts them where they appear (the prefetch) and waits at the
first action that consumes them. Sends never block. The dry run proves this model deadlock-free.

The :data:`UNIT_OPS` act on a *weight unit*: a stage's own weights (``s5``) or a *tie* (``t0``),
parameters several stages read (a tied embedding and head), named by its **home**, the lowest
stage reading it, owned with it and fetched once per step by a rank computing a reader without
owning it. A tie differs from a stage only in its readers and counters, and in being no stage of
``peak_resident_stages``."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Literal, NamedTuple, Sequence

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.jobs import weight_grad_phase
from lightning_gsched.schedule.lazy_ranks import LazyList


class Op(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    FETCH_W = "FETCH_W"
    SEND_W = "SEND_W"
    FREE_W = "FREE_W"
    REDUCE_G = "REDUCE_G"
    RECV_G = "RECV_G"
    ALLREDUCE_G = "ALLREDUCE_G"

    def __str__(self) -> str:
        return self.value


OpKind = Literal["compute", "send", "recv", "free", "collective"]


@dataclass(frozen=True)
class OpSpec:
    """What one op means. ``channel``: the FIFO channel a send or recv uses; ``matches``: the op
    at the message's other end; ``counter`` (``tie_counter``: a tie's): the
    :class:`~.counts.ActionCounts` field one action adds 1 to (None: counted otherwise or not)."""

    op: Op
    kind: OpKind
    meaning: str
    channel: str | None = None
    matches: Op | None = None
    counter: str | None = None
    forward_only: bool = False
    per_micro: bool = False
    tie_counter: str | None = None

    def counter_of(self, tie: bool) -> str | None:
        return self.tie_counter if tie else self.counter


OPS: dict[Op, OpSpec] = {spec.op: spec for spec in (
    OpSpec(Op.F, "compute", "forward of a stage on a microbatch; stashes what its backward needs",
           forward_only=True, per_micro=True),
    OpSpec(Op.B, "compute", "input-gradient of a stage (and its weight-gradient unless the "
           "programs split the backward); frees the stash unless split", per_micro=True),
    OpSpec(Op.W, "compute", "weight-gradient of a stage after its split B; frees the stash",
           per_micro=True),
    OpSpec(Op.SEND_ACT, "send", "send a forward's output to the rank of the next stage", "p2p",
           Op.RECV_ACT, "activation_sends", forward_only=True, per_micro=True),
    OpSpec(Op.RECV_ACT, "recv", "post the receive of a forward's output", "p2p", Op.SEND_ACT,
           "activation_recvs", forward_only=True, per_micro=True),
    OpSpec(Op.SEND_GRAD, "send", "send a backward's input-gradient to the producer's rank",
           "p2p", Op.RECV_GRAD, "input_grad_sends", per_micro=True),
    OpSpec(Op.RECV_GRAD, "recv", "post the receive of an input-gradient", "p2p", Op.SEND_GRAD,
           "input_grad_recvs", per_micro=True),
    # the weight-unit ops: a stage's or a tie's (Action.tie), one channel per kind for both
    OpSpec(Op.FETCH_W, "recv", "post the receive of a unit's weights; they become resident",
           "weights", Op.SEND_W, "weight_fetches", forward_only=True, tie_counter="tie_fetches"),
    OpSpec(Op.SEND_W, "send", "owner: send a unit's weights to a rank that fetches them",
           "weights", Op.FETCH_W, "weight_serves", forward_only=True, tie_counter="tie_serves"),
    OpSpec(Op.FREE_W, "free", "release a fetched unit's weights", forward_only=True),
    OpSpec(Op.REDUCE_G, "send", "send a fetched unit's accumulated gradient to its owner",
           "grads", Op.RECV_G, "grad_sends", tie_counter="tie_grad_sends"),
    OpSpec(Op.RECV_G, "recv", "owner: post the receive of a rank's gradient (summed in)",
           "grads", Op.REDUCE_G, "grad_recvs", tie_counter="tie_grad_recvs"),
    OpSpec(Op.ALLREDUCE_G, "collective", "all-reduce a unit's gradient among its owners",
           counter="allreduces", tie_counter="tie_allreduces"),
)}

UNIT_OPS = frozenset({Op.FETCH_W, Op.SEND_W, Op.FREE_W, Op.REDUCE_G, Op.RECV_G, Op.ALLREDUCE_G})
COMPUTE_OPS, SEND_OPS, RECV_OPS, COLLECTIVE_OPS = (
    frozenset(op for op, spec in OPS.items() if spec.kind == kind)
    for kind in ("compute", "send", "recv", "collective"))
FORWARD_ONLY_OPS = frozenset(op for op, spec in OPS.items() if spec.forward_only)
BACKWARD_OPS = frozenset(Op) - FORWARD_ONLY_OPS  # B, W, input-gradients, gradient reductions
# Each channel is FIFO per (src, dst): the k-th send on it matches the k-th receive posted on
# it. Separate channels let weights and gradients flow independently of activations.
CHANNEL_OF = {op: spec.channel for op, spec in OPS.items() if spec.channel is not None}
RECV_FOR_SEND = {op: spec.matches for op, spec in OPS.items() if op in SEND_OPS and spec.matches}


class RankGroup(tuple[int, ...]):
    """An all-reduce group that hashes once and tests membership in O(1) (the dry run asks every
    member ``rank in group``: O(W^2) with a plain tuple). Equal to, and hashing as, the tuple."""

    @cached_property
    def _hash(self) -> int:
        return tuple.__hash__(self)

    @cached_property
    def _members(self) -> frozenset[int]:
        return frozenset(self)

    def __hash__(self) -> int:
        return self._hash

    def __contains__(self, rank: object) -> bool:
        return rank in self._members


def weight_grad_op(forward_only: bool, split_backward: bool) -> Op | None:
    """The op of :func:`.jobs.weight_grad_phase`; None when forward-only."""
    return None if forward_only else Op(weight_grad_phase(split_backward).value)


class Action(NamedTuple):
    """One step of a rank's program. ``tie``: a unit op acts on the tie whose home is ``stage``
    (``t<home>``). A NamedTuple: lowering builds many, and a frozen dataclass costs 4x more."""

    op: Op
    stage: int
    micro: int | None = None
    peer: int | None = None
    group: tuple[int, ...] | None = None
    tie: bool = False

    def __str__(self) -> str:
        text = f"{self.op.value} {'t' if self.tie else 's'}{self.stage}"
        if self.micro is not None:
            text += f" b{self.micro}"
        if self.peer is not None:
            text += f" {'->' if self.op in SEND_OPS else '<-'}{self.peer}"
        if self.group is not None:
            text += " [" + ",".join(str(r) for r in self.group) + "]"
        return text

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str(action)``."""
        match = _PATTERN.match(text.strip())
        if match is None or match["op"] not in Op.__members__:
            raise ValueError(f"not an action: {text!r} (expected e.g. 'F s3 b1' or 'FETCH_W s5 <-1')")
        op = Op(match["op"])
        tie = match["unit"] == "t"
        if tie and op not in UNIT_OPS:
            raise ValueError(f"not an action: {text!r} (only the weight-unit ops "
                             f"{sorted(o.value for o in UNIT_OPS)} act on a tie 't<home>')")
        micro, peer, group = match["micro"], match["peer"], match["group"]
        return cls(op, int(match["stage"]), None if micro is None else int(micro),
                   None if peer is None else int(peer),
                   None if group is None else tuple(int(r) for r in group.split(",") if r), tie)


class Message(NamedTuple):
    """What one message carries, named alike at its send and its receive: the receive op that
    posts it, the stage (a tie's home, with ``tie``) and the microbatch (None for a unit's)."""

    op: Op
    stage: int
    micro: int | None
    tie: bool = False

    @classmethod
    def of(cls, action: Action) -> Message:
        return cls(RECV_FOR_SEND.get(action.op, action.op), action.stage, action.micro, action.tie)


SEND_FOR_RECV = {recv: send for send, recv in RECV_FOR_SEND.items()}
CHANNEL_KINDS = {kind: index for index, kind in enumerate(dict.fromkeys(CHANNEL_OF.values()))}


class Channel(NamedTuple):
    """One direction of one kind of traffic between two ranks, FIFO."""

    kind: str
    src: int
    dst: int

    @classmethod
    def of(cls, action: Action, rank: int) -> Channel:
        """The channel ``rank``'s send or receive ``action`` uses."""
        assert action.peer is not None
        kind = CHANNEL_OF[action.op]
        return cls(kind, rank, action.peer) if action.op in SEND_OPS else \
            cls(kind, action.peer, rank)

    def number(self, world: int) -> int:
        """A dense int for the channel among ``world`` ranks (as :func:`channel_bases`)."""
        return CHANNEL_KINDS[self.kind] * world * world + self.src * world + self.dst

    @classmethod
    def numbered(cls, number: int, world: int) -> Channel:
        kind, rest = divmod(number, world * world)
        src, dst = divmod(rest, world)
        return cls(next(k for k, i in CHANNEL_KINDS.items() if i == kind), src, dst)

    def __str__(self) -> str:
        return f"{self.kind} channel {self.src}->{self.dst}"


def channel_bases(world: int) -> dict[Op, int]:
    """Per send or receive op, the number of its channel kind's channel 0->0: a hot loop's
    ``base[op] + src * world + dst`` is :meth:`Channel.number`."""
    return {op: CHANNEL_KINDS[kind] * world * world for op, kind in CHANNEL_OF.items()}


def check_channel(channel: Channel, sent: Sequence[Message], posted: Sequence[Message]) -> None:
    """The one matching rule: a channel's sends and posts carry the same messages in the same
    order. The :class:`ProgramError` names the first unmatched message, else the first out of
    order."""
    if list(sent) == list(posted):
        return
    kind, src, dst = channel

    def send(message: Message) -> Action:
        return Action(SEND_FOR_RECV[message.op], message.stage, message.micro, dst, None,
                      message.tie)

    def post(message: Message) -> Action:
        return Action(message.op, message.stage, message.micro, src, None, message.tie)

    unmatched = Counter(sent)
    unmatched.subtract(posted)
    for message, extra in unmatched.items():
        if extra > 0:
            raise ProgramError(f"{channel}: rank {src} runs '{send(message)}' but rank {dst} "
                               "never receives it")
        if extra < 0:
            raise ProgramError(f"{channel}: rank {dst} posts '{post(message)}' but rank {src} "
                               "never sends it")
    k = next(k for k, (a, b) in enumerate(zip(sent, posted, strict=True)) if a != b)
    raise ProgramError(f"{channel} is out of order at message {k}: rank {src} sends "
                       f"'{send(sent[k])}' but rank {dst} posts '{post(posted[k])}'")


_PATTERN = re.compile(
    r"^(?P<op>[A-Z_]+) (?P<unit>[st])(?P<stage>\d+)(?: b(?P<micro>\d+))?"
    r"(?: (?P<dir>->|<-)(?P<peer>\d+))?(?: \[(?P<group>[\d,]*)\])?$")


@dataclass
class Programs:
    """Programs of all ranks plus the facts the runtime needs to execute them. ``owners[s]``: the
    ranks holding the source of truth of stage s (several: replicas, kept equal by
    ``ALLREDUCE_G``). ``ties``: tie home -> its reader stages (sorted). ``ranks``: each program
    made when first read. ``planned``: made by the planner's lowering (every all-reduce group is
    a replicated stage's owners), so a reader may answer from those facts."""

    ranks: LazyList[list[Action]]
    num_stages: int
    num_micro: int
    owners: list[tuple[int, ...]]
    edges: list[tuple[int, int]]
    forward_only: bool = False
    split_backward: bool = False
    ties: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # (the owners list it was built from, rank -> owned stages)
    _owned_index: tuple[list[tuple[int, ...]], dict[int, list[int]]] | None = field(
        default=None, init=False, repr=False, compare=False)
    planned: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        ranks: Sequence[list[Action]] = self.ranks
        if not isinstance(ranks, LazyList):
            self.ranks = LazyList.of(list(ranks))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def weight_grad_op(self) -> Op | None:
        return weight_grad_op(self.forward_only, self.split_backward)

    def owned_stages(self, rank: int) -> list[int]:
        """Ascending, from an index built on first use (a scan per rank would be O(W x S))."""
        index = self._owned_index
        if index is None or index[0] is not self.owners:
            by_rank: dict[int, list[int]] = {}
            for s, owners in enumerate(self.owners):
                for r in owners:
                    by_rank.setdefault(r, []).append(s)
            index = self._owned_index = (self.owners, by_rank)
        return list(index[1].get(rank, ()))

    def owned_ties(self, rank: int) -> list[int]:
        """Home stages of the ties ``rank`` owns (a tie is owned with its home stage)."""
        return [h for h in sorted(self.ties) if rank in self.owners[h]]

    def text(self, rank: int | None = None) -> str:
        """One action per line (all ranks when ``rank`` is None)."""
        lines: list[str] = []
        for r in range(self.world_size) if rank is None else [rank]:
            lines += [f"rank {r}:", *(f"  {a}" for a in self.ranks[r])]
        return "\n".join(lines)
