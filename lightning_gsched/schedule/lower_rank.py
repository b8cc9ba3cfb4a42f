"""Lower one rank's program without the others': what :func:`.lower.lower` gives that rank.

Why: at W=1024 fsdp's programs hold ~10 million actions (every rank fetches every stage it does
not own and serves its own to every other rank), more than a plan may take (1 GB), while a
rank needs only its own program. This lowering makes exactly the actions the full one makes
for rank r, in the same relative order, and nothing else:

- the lowering's builder keys every action (gap, category, time, serial) and sorts a rank's
  actions by key; only the *relative* order of serials matters, so calling the same puts that
  concern r in the same order as the full lowering gives the same program. The puts that
  concern r come from r's own runs and from the runs, on the ranks that fetch a stage r owns,
  of those stages (serving them, receiving their gradients); the full lowering visits workers
  in ascending order and each worker's runs in its order, and so does this one;
- the FIFO fix of a channel into r reads that channel's sends: the owners' weights to r (made
  by r's runs) and the gradients handed to r (made by the fetchers' runs); both are here, the
  sends out of r are r's own actions and need no fix;
- the data flow (activations, input gradients) into and out of r is made by visiting r and its
  consumers: with a timeline by symmetry (``Timeline.replicas``) that is r's group, whose
  workers feed only each other; otherwise every worker is visited;
- a fetcher's runs of a stage are read from an index of its order (stage -> runs), built once
  per distinct order: with a timeline by symmetry every worker of a group position has the
  same stages at the same places, so one index serves them all.

Each rule is the full lowering's own code (:func:`.lower.put_run`, the builder, the data flow,
the ties) run on a builder that keeps r's actions; tests compare every rank's program with the
full lowering's.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from operator import itemgetter
from typing import Any, Mapping

from lightning_gsched.schedule.jobs import Phase, StageGraph
from lightning_gsched.schedule.lower import _CATEGORY, _COMPUTE_OP, _Builder, put_run, stage_runs
from lightning_gsched.schedule.lower_flow import SLOTS, lower_data_flow
from lightning_gsched.schedule.lower_ties import lower_ties
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import (
    CHANNEL_OF,
    RECV_FOR_SEND,
    SEND_OPS,
    Action,
    Op,
    RankGroup,
)
from lightning_gsched.schedule.simulate import Timeline

# a message as its sender's builder files it: (stage, micro, the receive op that posts it)
SentMessage = tuple[int, "int | None", Op]
_Runs = tuple[list[tuple[int, int, int]], dict[int, list[tuple[int, int]]]]


class _RankBuilder(_Builder):
    """The lowering's builder keeping only what one rank's program needs (module docstring)."""

    def __init__(self, timeline: Timeline, rank: int, starts: dict[int, list[float]]) -> None:
        # no super(): its start times of every worker are what a rank-local lowering must not
        # build; ``starts`` (shared by the ranks lowered) holds those read so far
        W = len(timeline.order)
        self.timeline, self.rank = timeline, rank
        self.entries = [[] for _ in range(W)]
        self.flow = [[] for _ in range(W)]
        self.flow_keys = [[] for _ in range(W)]
        self.serial = 0
        self.sends = defaultdict(list)
        self.recvs = defaultdict(list)
        self._starts = starts
        # by symmetry, a rank's times are those of its position in replica 0
        replicas = timeline.replicas
        self._key = replicas.position if replicas is not None else int

    def gap_at(self, rank: int, time: float) -> int:
        key = self._key(rank)
        starts = self._starts.get(key)
        if starts is None:
            start = self.timeline.start
            starts = self._starts[key] = [start[j] for j in self.timeline.order[rank]]
        return bisect.bisect_left(starts, time)

    def put(self, rank: int, gap: int, time: float, action: Action) -> None:
        op = action.op
        if rank == self.rank and op not in SEND_OPS:
            super().put(rank, gap, time, action)  # a receive is filed for the FIFO fix
            return
        self.serial += 1  # what is not kept still takes its place in the order of serials
        if rank == self.rank:  # r's own send: nothing on r's side of its channel to fix
            self.entries[rank].append(((gap, _CATEGORY[op], time, self.serial), action))
        elif op in SEND_OPS and action.peer == self.rank:  # a send into r: orders r's posts
            self.sends[(CHANNEL_OF[op], rank, self.rank)].append(
                ((gap, _CATEGORY[op], time, self.serial),
                 (action.stage, action.micro, RECV_FOR_SEND[op])))


class RankLowering:
    """Lowers rank r's program on demand; the indexes it needs are built once and shared."""

    def __init__(self, graph: StageGraph, table: PlacementTable, timeline: Timeline,
                 fetch_window: int | None = None,
                 ties: Mapping[int, tuple[int, ...]] | None = None) -> None:
        self.graph, self.table, self.timeline = graph, table, timeline
        self.fetch_window = fetch_window
        self.ties = dict(ties or {})
        grad_phase = Phase.W if graph.split_backward else Phase.B
        self.grad_phase = grad_phase
        phases = timeline.phases
        self.grad_k = phases.index(grad_phase) if grad_phase in phases else -1
        self._runs: dict[int, _Runs] = {}  # by the worker whose order it indexes
        self._fetchers: dict[int, list[int]] | None = None
        self._groups: dict[int, RankGroup] = {}
        self._starts: dict[int, list[float]] = {}  # start times by worker (see _RankBuilder)
        self._ops = [_COMPUTE_OP[d] for d in phases]

    def program(self, rank: int) -> list[Action]:
        """What :func:`.lower.lower` gives ``rank`` (module docstring)."""
        return self._lower(rank)[0]

    def program_and_sends(
            self, rank: int,
    ) -> tuple[list[Action], dict[tuple[str, int, int], list[tuple[SentMessage, int]]]]:
        """:meth:`program`, and every channel into ``rank`` with the messages sent on it
        ((stage, micro, receive op) and the gap in the sender's program, in send order), for
        :mod:`.proof`'s rank check."""
        program, build = self._lower(rank)
        return program, sends_into(rank, build.flow, build.flow_keys, build.sends)

    def _lower(self, rank: int) -> tuple[list[Action], _RankBuilder]:
        timeline, table = self.timeline, self.table
        build = _RankBuilder(timeline, rank, self._starts)
        visit, indexed = self._flow_workers(rank)
        lower_data_flow(self.graph, table, timeline, build.flow, build.flow_keys, visit,
                        indexed)
        reduce_gaps = self._weights(build, rank)
        if not self.graph.forward_only:
            self._allreduce(build, rank, reduce_gaps)
        if self.ties:
            lower_ties(self.ties, table, timeline, build, self.grad_phase,
                       self.graph.forward_only)
        build.make_fifo()
        P, B = len(timeline.phases), table.micro
        ops = self._ops
        new_tuple = tuple.__new__
        computes = [new_tuple(Action, (ops[flat % P], flat // P // B, flat // P % B, None, None))
                    for flat in timeline.order[rank]]
        return build.program(rank, computes), build

    def _flow_workers(self, rank: int) -> tuple[list[int], list[int] | None]:
        """The consumers whose visit makes r's data flow (r, and the workers r sends to), and
        the workers whose positions key those messages (those and their producers): with a
        timeline by symmetry r's group (both); else read off r's jobs and theirs."""
        replicas = self.timeline.replicas
        if replicas is not None:
            return replicas.members(replicas.replica(rank)), None
        visit = sorted({rank} | self._neighbours(rank, consumers=True))
        indexed = set(visit)
        for worker in visit:
            indexed |= self._neighbours(worker, consumers=False)
        return visit, sorted(indexed)

    def _neighbours(self, worker: int, consumers: bool) -> set[int]:
        """The workers that consume ``worker``'s activations and input gradients (or produce
        those ``worker`` consumes): F s b feeds F of s's outputs, B s b the B of its inputs."""
        graph, compute, timeline = self.graph, self.table.compute, self.timeline
        P, BP = len(timeline.phases), self.table.micro * len(timeline.phases)
        phases = timeline.phases
        out: set[int] = set()
        for flat in timeline.order[worker]:
            phase = phases[flat % P]
            if phase is Phase.W:
                continue
            s, b = flat // BP, flat % BP // P
            forward = phase is Phase.F
            others = graph.outputs(s) if forward is consumers else graph.inputs(s)
            out.update(compute[o][b] for o in others)
        out.discard(worker)
        return out

    def _index(self, worker: int) -> _Runs:
        """(stage, i, j) of every run of ``worker``'s order, and per stage its (i, j)."""
        replicas = self.timeline.replicas
        key = replicas.position(worker) if replicas is not None else worker
        runs = self._runs.get(key)
        if runs is None:
            BP = self.table.micro * len(self.timeline.phases)
            stages = [flat // BP for flat in self.timeline.order[worker]]
            listed = stage_runs(stages, self.table.hold_fetched_for_step)
            by_stage: dict[int, list[tuple[int, int]]] = {}
            for stage, i, j in listed:
                by_stage.setdefault(stage, []).append((i, j))
            runs = self._runs[key] = (listed, by_stage)
        return runs

    def _fetched_runs(self, worker: int) -> list[tuple[int, int, int, int]]:
        """(stage, i, j, fetch gap) of every run ``worker`` fetches, as ``_lower_weights``."""
        table = self.table
        owned = set(table.owned_stages(worker))
        if table.computed_stages(worker) <= owned:
            return []
        out: list[tuple[int, int, int, int]] = []
        freed_at: list[int] = []
        window = self.fetch_window
        for stage, i, j in self._index(worker)[0]:
            if stage in owned:
                continue
            fetch_gap = max(i - 1, 0)
            if window is not None and len(freed_at) >= window:
                fetch_gap = max(fetch_gap, freed_at[-window])
            out.append((stage, i, j, fetch_gap))
            freed_at.append(j + 1)
        return out

    def _served(self, worker: int, owner: int) -> list[tuple[int, int, int, int]]:
        """The runs of ``worker`` that fetch a stage from ``owner``, in ``worker``'s order."""
        table = self.table
        if self.fetch_window is not None:  # a fetch gap depends on the runs before it
            return [run for run in self._fetched_runs(worker)
                    if table.fetch_source[(run[0], worker)] == owner]
        owned = set(table.owned_stages(worker))
        by_stage = self._index(worker)[1]
        runs = [(stage, i, j, max(i - 1, 0))
                for stage in table.owned_stages(owner)
                if stage not in owned and table.fetch_source.get((stage, worker)) == owner
                for i, j in by_stage.get(stage, ())]
        runs.sort(key=lambda run: run[1])
        return runs

    def _fetchers_of(self, owner: int) -> list[int]:
        if self._fetchers is None:
            index: dict[int, set[int]] = {}
            for (_, worker), source in self.table.fetch_source.items():
                index.setdefault(source, set()).add(worker)
            self._fetchers = {w: sorted(ws) for w, ws in index.items()}
        return self._fetchers.get(owner, [])

    def _weights(self, build: _RankBuilder, rank: int) -> dict[tuple[int, int], int]:
        reduce_gaps: dict[tuple[int, int], int] = {}
        table, timeline, grad_k = self.table, self.timeline, self.grad_k
        for worker in sorted({rank, *self._fetchers_of(rank)}):
            runs = self._fetched_runs(worker) if worker == rank else self._served(worker, rank)
            for stage, i, j, fetch_gap in runs:
                put_run(table, timeline, build, worker, stage, i, j, fetch_gap, grad_k,
                        reduce_gaps)
        return reduce_gaps

    def _allreduce(self, build: _RankBuilder, rank: int,
                   reduce_gaps: dict[tuple[int, int], int]) -> None:
        """``_lower_allreduce``'s actions of ``rank``: after its last gradient job of a stage."""
        owners = self.table.owners
        mine = [s for s in self.table.owned_stages(rank) if len(owners[s]) >= 2]
        if not mine:
            return
        P = len(self.timeline.phases)
        BP = self.table.micro * P
        end = self.timeline.end
        last: dict[int, tuple[int, float]] = {}
        for i, flat in enumerate(self.timeline.order[rank]):
            if flat % P == self.grad_k:
                last[flat // BP] = (i + 1, end[flat])
        for stage in mine:
            group = self._groups.get(stage)
            if group is None:
                group = self._groups[stage] = RankGroup(owners[stage])
            gap, time = last.get(stage, (0, 0.0))
            gap = max(gap, reduce_gaps.get((rank, stage), 0))
            build.put(rank, gap, time, Action(Op.ALLREDUCE_G, stage, None, None, group))


def sends_into(rank: int, flow: list[list[Action]], flow_keys: list[list[int]],
               put_sends: Mapping[tuple[str, int, int], list[tuple[Any, SentMessage]]],
               ) -> dict[tuple[str, int, int], list[tuple[SentMessage, int]]]:
    """Every channel into ``rank``: its messages (stage, micro, receive op) in send order, each
    with its gap in the sender's program (it comes right before the sender's compute of that
    position), from a rank-local lowering's builder: the data flow's sends in their program
    order (small keys ``gap * SLOTS + category``), then the other sends by their full keys."""
    out: dict[tuple[str, int, int], list[tuple[SentMessage, int]]] = {}
    first = itemgetter(0)
    for src, actions in enumerate(flow):
        if src == rank or not actions:
            continue
        keys = flow_keys[src]
        for index in sorted(range(len(actions)), key=keys.__getitem__):  # stable
            action = actions[index]
            if action.peer == rank and action.op in RECV_FOR_SEND:
                out.setdefault((CHANNEL_OF[action.op], src, rank), []).append(
                    ((action.stage, action.micro, RECV_FOR_SEND[action.op]),
                     keys[index] // SLOTS))
    for channel, sent in put_sends.items():
        if channel[2] == rank:
            out.setdefault(channel, []).extend((ident, key[0])
                                               for key, ident in sorted(sent, key=first))
    return out
