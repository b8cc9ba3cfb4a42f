"""Lower a timeline to one program per rank: every rank's, or only the ranks asked for.

Each worker's compute jobs keep their simulated order. Between two computes ("gaps") the lowering
inserts the data flow, each send right after its compute and each receive posted one compute
early so that the transfer overlaps that compute (:mod:`.lower_build`), and the weight actions
(:mod:`.lower_weights`). Every channel is made FIFO-consistent: receives are posted in the order
the peer sends, moving a post earlier when needed (never later), so that backends without
message tags (NCCL) can run the same programs.

**One pass for any set of ranks** (:meth:`Lowering.programs`; why: :mod:`.lazy_ranks`): the
builder keeps only those ranks' actions, and the rules visit only what concerns them: the data
flow of the kept ranks and their consumers (by symmetry, their replicas, whose workers feed only
each other), their own weight runs and those of the ranks fetching from them. Every rule visits
workers and runs in the order the lowering of every rank does, and the builder orders actions by
the relative order of their serials, so a rank's program is the same whichever ranks are made.
"""

from __future__ import annotations

from collections.abc import Collection
from operator import itemgetter
from typing import Sequence

from lightning_gsched.schedule.consumption import OpRules
from lightning_gsched.schedule.jobs import Phase, StageGraph
from lightning_gsched.schedule.lazy_ranks import LazyList
from lightning_gsched.schedule.lower_build import SLOTS, Builder, lower_data_flow
from lightning_gsched.schedule.lower_weights import Ties, WeightLowering
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import RECV_FOR_SEND, Action, Channel, Message, Op, Programs
from lightning_gsched.schedule.simulate import Timeline

_COMPUTE_OP = {Phase.F: Op.F, Phase.B: Op.B, Phase.W: Op.W}
Sends = dict[Channel, list[tuple[Message, int]]]  # per channel, (message, gap in the sender's)


class Lowering:
    """Lowers programs of a timeline on demand; the indexes they need are built once."""

    def __init__(self, graph: StageGraph, table: PlacementTable, timeline: Timeline,
                 fetch_window: int | None = None, ties: Ties | None = None) -> None:
        self.graph, self.table, self.timeline = graph, table, timeline
        self.rules = OpRules(graph)  # built once for every rank lowered
        self.weights = WeightLowering(graph, table, timeline, fetch_window, ties)
        self._starts: dict[int, list[float]] = {}  # start times by worker, shared by builders
        self._ops = [_COMPUTE_OP[d] for d in timeline.phases]

    def programs(self, ranks: Collection[int] | None = None) -> list[list[Action]]:
        """The programs of ``ranks`` (None: every rank), in that order."""
        build = self._lower(None if ranks is None else set(ranks))
        wanted = range(len(self.timeline.order)) if ranks is None else ranks
        return [build.program(rank, self._computes(rank)) for rank in wanted]

    def program(self, rank: int) -> list[Action]:
        """``rank``'s program, lowered alone."""
        return self.programs([rank])[0]

    def program_and_sends(self, rank: int) -> tuple[list[Action], Sends]:
        """:meth:`program`, and every channel into ``rank`` with the messages sent on it, in
        send order, each with its gap in the sender's program, for :mod:`.proof`'s rank check."""
        build = self._lower({rank})
        sends: Sends = {}
        # the data flow's sends in their program order (small keys gap * SLOTS + category)
        for src, actions in enumerate(build.flow):
            if src == rank or not actions:
                continue
            keys = build.flow_keys[src]
            for index in sorted(range(len(actions)), key=keys.__getitem__):  # stable
                action = actions[index]
                if action.peer == rank and action.op in RECV_FOR_SEND:
                    sends.setdefault(Channel.of(action, src), []).append(
                        (Message.of(action), keys[index] // SLOTS))
        # then the other sends, by their full keys (gap, ...)
        for channel, sent in build.sends.items():
            if channel[2] == rank:
                sends.setdefault(channel, []).extend(
                    (message, key[0]) for key, message in sorted(sent, key=itemgetter(0)))
        return build.program(rank, self._computes(rank)), sends

    def _lower(self, keep: set[int] | None) -> Builder:
        build = Builder(self.timeline, keep, self._starts)
        visit, indexed = self._flow_workers(keep)
        lower_data_flow(self.graph, self.rules, self.table, build, visit, indexed)
        self.weights.lower(build)
        build.make_fifo()
        return build

    def _computes(self, rank: int) -> list[Action]:
        P, B, ops = len(self.timeline.phases), self.table.micro, self._ops
        new_tuple = tuple.__new__  # Action(...) without the NamedTuple __new__ frame
        return [new_tuple(Action, (ops[flat % P], flat // P // B, flat // P % B, None, None, False))
                for flat in self.timeline.order[rank]]

    def _flow_workers(self, keep: set[int] | None) -> tuple[list[int] | None, list[int] | None]:
        """The consumers to visit for the kept ranks' data flow (they and the workers they send
        to), and the workers whose positions key those messages (those and their producers); by
        symmetry, the kept ranks' replicas for both (None: every worker)."""
        if keep is None:
            return None, None
        replicas = self.timeline.replicas
        if replicas is not None:
            return sorted({m for r in keep for m in replicas.members(replicas.replica(r))}), None
        visit = sorted(set(keep).union(*(self._neighbours(r, consumers=True) for r in keep)))
        indexed = set(visit)
        for worker in visit:
            indexed |= self._neighbours(worker, consumers=False)
        return visit, sorted(indexed)

    def _neighbours(self, worker: int, consumers: bool) -> set[int]:
        """The workers that consume ``worker``'s activations and input gradients (or produce
        those it consumes)."""
        graph, compute, phases = self.graph, self.table.compute, self.timeline.phases
        P = len(phases)
        BP = self.table.micro * P
        out: set[int] = set()
        for flat in self.timeline.order[worker]:
            phase = phases[flat % P]
            if phase is Phase.W:
                continue
            s, b = flat // BP, flat % BP // P
            others = graph.outputs(s) if (phase is Phase.F) is consumers else graph.inputs(s)
            out.update(compute[o][b] for o in others)
        out.discard(worker)
        return out


def lower(graph: StageGraph, table: PlacementTable, timeline: Timeline,
          fetch_window: int | None = None, ties: Ties | None = None) -> Programs:
    """Every rank's program of a simulated timeline. ``fetch_window``: the most fetched stages
    a worker may hold at once (None: no limit beyond the one-compute-early prefetch, which never
    holds more than two, so 2 or more is the same). ``ties``: ``{home stage: reader stages}``."""
    ranks = Lowering(graph, table, timeline, fetch_window, ties).programs()
    return programs_of(graph, table, ranks, ties)


def programs_of(graph: StageGraph, table: PlacementTable, ranks: Sequence[list[Action]],
                ties: Ties | None) -> Programs:
    """:class:`Programs` of ``ranks`` (a list, or a :class:`LazyList` lowered per rank) with
    the facts the runtime needs beside them."""
    edges = [(u, v) for u in range(graph.num_stages) for v in graph.outputs(u)]
    lazy = ranks if isinstance(ranks, LazyList) else LazyList.of(list(ranks))
    return Programs(lazy, table.stages, table.micro, list(table.owners), edges,
                    forward_only=graph.forward_only, split_backward=graph.split_backward,
                    ties=dict(ties or {}), planned=True)
