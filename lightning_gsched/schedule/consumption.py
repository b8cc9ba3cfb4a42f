"""What each action consumes and releases: the rules every reader of programs shares.

The dry run, the time replay, the bytes walk and the runtime's step must agree on which posted
receive an action consumes, which fetched units a compute needs and which op ends a stash;
written in each, the copies drifted. For a compute of stage s on microbatch b:

* ``F s b`` reads the output of ``F p b`` for every producer p of s (none: the model's input);
  from another rank that is the posted ``RECV_ACT p b``;
* ``B s b`` reads the input-gradient of ``B c b`` for every consumer c of s (none: s is a sink
  and starts from its own loss), from another rank the posted ``RECV_GRAD c b``, and its stash;
* ``W s b`` (split backward only) reads what ``B s b`` left on the same rank, nothing posted;
* every compute of s needs s's weights and those of each tie s reads: a posted ``FETCH_W`` of
  the unit is consumed by the first compute that needs it, or by the unit's ``FREE_W``;
* ``F`` stashes (unless forward-only); the weight-gradient op (:func:`~.program.weight_grad_op`)
  accumulates the weight gradients and releases the stash; a split ``B`` narrows the stash to
  what ``W`` needs (``StageSizes.b_released``, ``StageSizes.w_grads``);
* ``ALLREDUCE_G`` of a unit sums in the gradients posted by ``RECV_G`` of the same unit; those
  never all-reduced are summed in at the step's end.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule.jobs import Phase, StageGraph
from lightning_gsched.schedule.program import Action, Message, Op, Programs, weight_grad_op

# A weight unit as its actions name it: (stage, False) or (tie home, True); see unit_of.
UnitKey = tuple[int, bool]


def unit_of(action: Action) -> UnitKey:
    """The weight unit a unit op (``FETCH_W`` ... ``ALLREDUCE_G``) acts on."""
    return (action.stage, action.tie)


def require_chain(num_stages: int, edges: Iterable[tuple[int, int]] | None) -> None:
    """Refuse a stage graph other than the chain 0 -> 1 -> ... -> S-1: the runtime executes
    chains only (a message names its producer stage, not which of several inputs it feeds).
    :class:`StageGraph` checks the edges' range first, so that an invalid edge is named."""
    if edges is None:
        return
    edges = list(edges)
    if not StageGraph(num_stages, edges).is_chain:
        raise ScheduleConfigError(
            f"edges={edges} is not the chain of {num_stages} stages (stage s feeding s+1); the "
            "runtime executes only chains, so plan() refuses other stage graphs until it runs "
            "them. Partition the model into a chain (partition() does) and leave out edges=, "
            f"or pass edges={[(s, s + 1) for s in range(num_stages - 1)]}"
        )


class OpRules:
    """The rules as tables indexed by stage, built once for the readers' hot loops: ``act_from``,
    the producers whose outputs ``F s`` reads; ``grad_from``, the consumers whose input-gradients
    ``B s`` reads; ``ties_read``, the homes of the ties s reads; ``units_read``, s and those."""

    __slots__ = ("num_stages", "forward_only", "split_backward", "act_from", "grad_from",
                 "ties_read", "units_read", "stash_op", "weight_grad_op")

    def __init__(self, graph: StageGraph, ties: Mapping[int, Sequence[int]] | None = None) -> None:
        num_stages = self.num_stages = graph.num_stages
        self.forward_only, self.split_backward = graph.forward_only, graph.split_backward
        self.act_from: tuple[tuple[int, ...], ...] = tuple(
            tuple(graph.inputs(s)) for s in range(num_stages))
        self.grad_from: tuple[tuple[int, ...], ...] = tuple(
            tuple(graph.outputs(s)) for s in range(num_stages))
        ties = ties or {}
        self.ties_read: tuple[tuple[int, ...], ...] = tuple(
            tuple(h for h in sorted(ties) if s in ties[h]) for s in range(num_stages))
        self.units_read: tuple[tuple[UnitKey, ...], ...] = tuple(
            ((s, False), *((h, True) for h in self.ties_read[s])) for s in range(num_stages))
        self.stash_op: Op | None = None if self.forward_only else Op.F
        self.weight_grad_op: Op | None = weight_grad_op(self.forward_only, self.split_backward)

    @classmethod
    def of(cls, programs: Programs, edges: Sequence[tuple[int, int]] | None = None) -> "OpRules":
        """The rules of ``programs`` (``edges``: another stage graph to read them with)."""
        graph = StageGraph(programs.num_stages, programs.edges if edges is None else edges,
                           programs.forward_only, programs.split_backward)
        return cls(graph, programs.ties)

    def reads(self, op: Op, stage: int) -> tuple[tuple[Phase, int], ...]:
        """The jobs (phase, stage), on the same microbatch, whose results a compute reads."""
        if op is Op.F:
            return tuple((Phase.F, p) for p in self.act_from[stage])
        if op is Op.B:
            consumers = self.grad_from[stage]
            return (tuple((Phase.B, c) for c in consumers) if consumers
                    else ((Phase.F, stage),))  # a sink: its own forward's loss
        return ((Phase.B, stage),)  # W: what its B left

    def messages_read(self, action: Action) -> list[Message]:
        """The posted receives ``action`` consumes when their producers ran on another rank."""
        op, s, b = action.op, action.stage, action.micro
        if op is Op.F:
            return [Message(Op.RECV_ACT, p, b) for p in self.act_from[s]]
        if op is Op.B:
            return [Message(Op.RECV_GRAD, c, b) for c in self.grad_from[s]]
        return []

    def narrows_stash(self, op: Op) -> bool:
        """Whether ``op`` narrows its stash without ending it: a split ``B``."""
        return op is Op.B and self.split_backward and not self.forward_only

