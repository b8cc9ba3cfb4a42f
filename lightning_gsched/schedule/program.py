"""The program IR: one ordered list of actions per rank.

The planner costs and draws these programs and the runtime executes them, so they are the single
source of truth for what happens on a rank. Every action has a compact text form that round-trips
through :meth:`Action.parse`, for error messages, test diffs and bug reports:

====================  =========================================================================
``F s3 b1``           forward of stage 3 on microbatch 1 (stashes its activations)
``B s3 b1``           backward of stage 3 on microbatch 1 (frees the stash, accumulates grads)
``SEND_ACT s3 b1 ->2``  send the output of ``F s3 b1`` to rank 2
``RECV_ACT s3 b1 <-1``  post the receive of the output of ``F s3 b1`` from rank 1
``SEND_GRAD s4 b1 ->3`` send the input-gradient produced by ``B s4 b1`` to rank 3
``RECV_GRAD s4 b1 <-2`` post the receive of the input-gradient produced by ``B s4 b1``
``FETCH_W s5 <-1``    post the receive of stage 5's weights from owner 1 (they become resident)
``SEND_W s5 ->3``     owner side of a fetch: send stage 5's weights to rank 3
``FREE_W s5``         release the fetched weights of stage 5
``REDUCE_G s5 ->1``   send this rank's accumulated gradient of stage 5 to its owner 1
``RECV_G s5 <-3``     owner side: post the receive of rank 3's gradient of stage 5 (summed in)
``ALLREDUCE_G s5 [0,2]``  all-reduce stage 5's gradient among its replica owners 0 and 2
====================  =========================================================================

Receives are *posts*: the runtime starts them where they appear (that is the prefetch) and waits
for them at the first action that consumes them. Sends never block. That is also the model the
dry run (:mod:`lightning_gsched.schedule.dryrun`) proves deadlock-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class Op(str, Enum):
    F = "F"
    B = "B"
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


COMPUTE_OPS = frozenset({Op.F, Op.B})
SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD, Op.SEND_W, Op.REDUCE_G})
RECV_OPS = frozenset({Op.RECV_ACT, Op.RECV_GRAD, Op.FETCH_W, Op.RECV_G})
# What a forward-only program (plan(..., forward_only=True)) may contain.
FORWARD_ONLY_OPS = frozenset({Op.F, Op.SEND_ACT, Op.RECV_ACT, Op.FETCH_W, Op.SEND_W, Op.FREE_W})
BACKWARD_OPS = frozenset(Op) - FORWARD_ONLY_OPS  # B, input-gradients, gradient reductions
_MICRO_OPS = frozenset({Op.F, Op.B, Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD, Op.RECV_GRAD})
_OUT_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD, Op.SEND_W, Op.REDUCE_G})

# Message channels. Each channel is FIFO per (src, dst): the k-th send on a channel matches the
# k-th receive posted on it. Separate channels let weights and gradients flow independently of
# activations (the runtime maps each to its own tag / process group).
CHANNEL_OF = {
    Op.SEND_ACT: "p2p", Op.RECV_ACT: "p2p", Op.SEND_GRAD: "p2p", Op.RECV_GRAD: "p2p",
    Op.SEND_W: "weights", Op.FETCH_W: "weights",
    Op.REDUCE_G: "grads", Op.RECV_G: "grads",
}
# Which receive matches which send.
RECV_FOR_SEND = {Op.SEND_ACT: Op.RECV_ACT, Op.SEND_GRAD: Op.RECV_GRAD, Op.SEND_W: Op.FETCH_W,
                 Op.REDUCE_G: Op.RECV_G}


class Action(NamedTuple):
    """One step of a rank's program. ``peer`` is the other rank of a message.

    Immutable and hashable. A NamedTuple rather than a frozen dataclass because lowering builds
    ~10^5 of them for W=64, S=64, B=256 and a frozen dataclass costs 4x more per instance.
    """

    op: Op
    stage: int
    micro: int | None = None
    peer: int | None = None
    group: tuple[int, ...] | None = None

    def __str__(self) -> str:
        text = f"{self.op.value} s{self.stage}"
        if self.micro is not None:
            text += f" b{self.micro}"
        if self.peer is not None:
            text += f" {'->' if self.op in _OUT_OPS else '<-'}{self.peer}"
        if self.group is not None:
            text += " [" + ",".join(str(r) for r in self.group) + "]"
        return text

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    def message_key(self, rank: int) -> tuple[str, int, int | None, int | None, int | None]:
        """Identity of the message this send/recv carries, the same on both ends (no seq no.)."""
        src, dst = (rank, self.peer) if self.op in SEND_OPS else (self.peer, rank)
        return (CHANNEL_OF[self.op], self.stage, self.micro, src, dst)

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str(action)``."""
        match = _PATTERN.match(text.strip())
        if match is None or match["op"] not in Op.__members__:
            raise ValueError(f"not an action: {text!r} (expected e.g. 'F s3 b1' or 'FETCH_W s5 <-1')")
        op = Op(match["op"])
        group = match["group"]
        return cls(
            op,
            int(match["stage"]),
            int(match["micro"]) if match["micro"] is not None else None,
            int(match["peer"]) if match["peer"] is not None else None,
            tuple(int(r) for r in group.split(",") if r) if group is not None else None,
        )


_PATTERN = re.compile(
    r"^(?P<op>[A-Z_]+) s(?P<stage>\d+)(?: b(?P<micro>\d+))?"
    r"(?: (?P<dir>->|<-)(?P<peer>\d+))?(?: \[(?P<group>[\d,]*)\])?$"
)


@dataclass
class Programs:
    """Programs of all ranks plus the facts the runtime needs to execute them.

    ``owners[s]`` are the ranks that hold the source of truth of stage s (more than one means
    replicas, kept equal by ``ALLREDUCE_G``); ``edges`` is the stage graph. ``forward_only``
    programs (validation, test, predict) contain only :data:`FORWARD_ONLY_OPS`.
    """

    ranks: list[list[Action]]
    num_stages: int
    num_micro: int
    owners: list[tuple[int, ...]]
    edges: list[tuple[int, int]]
    forward_only: bool = False

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def owned_stages(self, rank: int) -> list[int]:
        return [s for s, owners in enumerate(self.owners) if rank in owners]

    def text(self, rank: int | None = None) -> str:
        """Human-readable programs, one action per line (all ranks when ``rank`` is None)."""
        ranks = range(self.world_size) if rank is None else [rank]
        lines = []
        for r in ranks:
            lines.append(f"rank {r}:")
            lines.extend(f"  {a}" for a in self.ranks[r])
        return "\n".join(lines)
