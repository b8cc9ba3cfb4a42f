"""Step time of a plan's programs once transfers take time: a replay, not a new schedule.

Why: the simulator decides *orders* with compute costs only, and the runtime executes those
orders as they are. On a real machine a microbatch's activation takes time to reach the next
worker, a gradient all-reduce or a gradient hand-off to the owner runs after the last backward
of a stage, and a weight fetch must arrive before the stage computes. ``predict_step_time``
walks every rank's program in order (a handler of the program walker, :mod:`.walk`), with the
same dependencies as the simulator, and lets
each of those messages take its measured time; compute and order stay the plan's. With all
communication costs 0 it returns the plan's own latency.

Model (what is and is not counted):

* activation / input-gradient message between two workers: ``transfer`` seconds from the end
  of the producing job to the earliest start of the consuming job (same worker: no delay);
* ``FETCH_W`` of stage s: the weights are ready ``fetch[s]`` seconds after the rank reaches the
  fetch in its program (fetches are asynchronous); the stage's next compute waits for them;
* ``ALLREDUCE_G`` / ``REDUCE_G`` of stage s: asynchronous, started when every member of the
  group (or the sender) has reached it, finished ``reduce[s]`` seconds later; the step ends
  when the last one has finished;
* ties (``plan.ties``): ``FETCH_T`` of tie h like ``FETCH_W`` (``tie_fetch[h]`` seconds; every
  compute of a stage reading the tie waits for it), ``REDUCE_T`` / ``ALLREDUCE_T`` like the
  stage reductions (``tie_reduce[h]`` seconds); see :class:`_TieTimes`;
* not modelled: CPU time spent issuing messages (it is charged to nobody), contention of
  several transfers for one link, and the optimizer step after the programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule.jobs import Job, Phase, StageGraph
from lightning_gsched.schedule.program import Action, Op
from lightning_gsched.schedule.walk import Walker


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds (or cost units) of one step of a plan's programs."""

    latency: float  # end of the last compute job or reduction on any worker
    compute_only: float  # the plan's own latency (every communication cost 0)
    worker_end: tuple[float, ...]  # per worker: its last compute job or reduction

    @property
    def communication_share(self) -> float:
        """Fraction of the predicted step added by communication."""
        return 1 - self.compute_only / self.latency if self.latency else 0.0


def _per_stage(label: str, value: float | Sequence[float], stages: int) -> list[float]:
    values = [float(value)] * stages if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != stages or any(v < 0 for v in values):
        raise ScheduleConfigError(
            f"{label}: give one non-negative number or one per stage ({stages}), got {value!r}"
        )
    return values


class _Replay:
    """Walk handler: each compute starts when its worker, its inputs and its weights are ready."""

    def __init__(self, plan: Any, graph: StageGraph, walker: Walker, transfer: float,
                 fetch: list[float], reduce: list[float], ties: "_TieTimes") -> None:
        W = plan.workers
        self.graph, self.walker, self.transfer = graph, walker, transfer
        self.fetch, self.reduce = fetch, reduce
        self.costs = plan.costs
        self.done: dict[Job, tuple[float, int]] = {}  # job -> (end, worker)
        self.clock = [0.0] * W
        self.ends = [0.0] * W
        self.weights_ready: list[dict[int, float]] = [{} for _ in range(W)]
        # (op, stage, group) of an all-reduce -> when each member reached it
        self.reductions: dict[tuple[Op, int, tuple[int, ...] | None], list[float]] = {}
        self.ties = ties

    def compute(self, w: int, a: Action) -> Job | None:
        job = Job(a.stage, a.micro, _PHASE[a.op])  # type: ignore[arg-type]  # compute: micro set
        at = 0.0
        for pred in self.graph.pred(job):
            if pred not in self.done:
                return pred  # wait until that job has run
            end, pw = self.done[pred]
            at = max(at, end + (self.transfer if pw != w else 0.0))
        start = max(self.clock[w], at, self.weights_ready[w].get(a.stage, 0.0),
                    self.ties.ready(w, a.stage))
        end = start + self.costs.of(job)
        self.done[job] = (end, w)
        self.clock[w] = self.ends[w] = end
        self.walker.wake(job)
        return None

    def recv(self, w: int, a: Action) -> None:
        if a.op is Op.FETCH_W:
            self.weights_ready[w][a.stage] = self.clock[w] + self.fetch[a.stage]
        elif a.op is Op.FETCH_T:
            self.ties.fetched(w, a.stage, self.clock[w])

    def send(self, w: int, a: Action) -> None:
        if a.op is Op.REDUCE_G:
            self.ends[w] = max(self.ends[w], self.clock[w] + self.reduce[a.stage])
        elif a.op is Op.REDUCE_T:
            self.ends[w] = max(self.ends[w], self.clock[w] + self.ties.reduce[a.stage])

    def free(self, w: int, a: Action) -> None:
        return None

    def collective(self, w: int, a: Action) -> None:
        self.reductions.setdefault((a.op, a.stage, a.group), []).append(self.clock[w])

    def reduction_time(self, op: Op, stage: int) -> float:
        return self.ties.reduce[stage] if op is Op.ALLREDUCE_T else self.reduce[stage]


class _TieTimes:
    """The tie terms of the replay: when each rank's fetched ties arrive, what reductions take.

    ``fetch`` / ``reduce``: seconds per tie home stage; ``read_by[s]``: the ties stage s reads.
    """

    def __init__(self, plan: Any, W: int, fetch: float | Mapping[int, float],
                 reduce: float | Mapping[int, float]) -> None:
        ties = plan.programs.ties
        self.read_by = {s: plan.programs.ties_read_by(s) for s in range(plan.stages)}
        self.fetch = _per_tie("tie_fetch", fetch, ties)
        self.reduce = _per_tie("tie_reduce", reduce, ties)
        self.arrive: list[dict[int, float]] = [{} for _ in range(W)]

    def fetched(self, w: int, home: int, at: float) -> None:
        self.arrive[w][home] = at + self.fetch[home]

    def ready(self, w: int, stage: int) -> float:
        """When the ties ``stage`` reads are on worker ``w`` (0: owned, or none)."""
        arrive = self.arrive[w]
        return max((arrive.get(h, 0.0) for h in self.read_by[stage]), default=0.0)


def _per_tie(label: str, value: float | Mapping[int, float],
             ties: Mapping[int, Sequence[int]]) -> dict[int, float]:
    values = ({h: float(value) for h in ties} if isinstance(value, (int, float))
              else {int(h): float(v) for h, v in value.items()})
    if set(values) != set(ties) or any(v < 0 for v in values.values()):
        raise ScheduleConfigError(
            f"{label}: give one non-negative number or one per tie home stage "
            f"({sorted(ties)}), got {value!r}"
        )
    return values


_PHASE = {Op.F: Phase.F, Op.B: Phase.B, Op.W: Phase.W}


def predict_step_time(plan: Any, transfer: float = 0.0, fetch: float | Sequence[float] = 0.0,
                      reduce: float | Sequence[float] = 0.0,
                      edges: Sequence[tuple[int, int]] | None = None,
                      tie_fetch: float | Mapping[int, float] = 0.0,
                      tie_reduce: float | Mapping[int, float] = 0.0) -> StepPrediction:
    """Replay ``plan``'s programs with communication costs (see module docstring).

    ``plan``: a :class:`~lightning_gsched.schedule.plan.Plan`; its ``costs`` give the compute
    time of every job. ``edges``: the stage graph if it is not a chain (as given to ``plan``).
    ``tie_fetch`` / ``tie_reduce``: seconds of a tie's fetch / gradient reduction, one number
    or ``{home stage: seconds}`` for every tie of ``plan.ties``.
    """
    if transfer < 0:
        raise ScheduleConfigError(f"transfer must be >= 0 seconds, got {transfer!r}")
    S, W = plan.stages, plan.workers
    fetch_s = _per_stage("fetch", fetch, S)
    reduce_s = _per_stage("reduce", reduce, S)
    graph = StageGraph(S, edges, forward_only=plan.forward_only,
                       split_backward=plan.programs.split_backward)
    walker = Walker(plan.programs)
    replay = _Replay(plan, graph, walker, transfer, fetch_s, reduce_s,
                     _TieTimes(plan, W, tie_fetch, tie_reduce))
    stuck = walker.run(replay)
    if stuck:
        raise ScheduleConfigError(
            f"the programs of workers {stuck} cannot be replayed (a compute job waits for one "
            "that never runs); were they lowered from this plan?"
        )
    ends = replay.ends
    for (op, stage, group), reached in replay.reductions.items():
        finish = max(reached) + replay.reduction_time(op, stage)
        for w in group or range(W):
            ends[w] = max(ends[w], finish)
    return StepPrediction(max(ends) if ends else 0.0, plan.metrics.latency, tuple(ends))
