"""``plan()``: from a schedule name (or two callables) to a verified, measured set of programs;
the one entry point the CLI, the planner report and the Lightning strategy share, so the numbers a
user reads before training are those of the programs the runtime will execute.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from lightning_gsched.errors import CapTooSmallError, ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.arguments import DEFAULT, ScheduleArguments
from lightning_gsched.schedule.cap_search import auto_cap_timeline, smallest_feasible_cap
from lightning_gsched.schedule.consumption import require_chain
from lightning_gsched.schedule.data_parallel import (
    lift,
    lift_caps,
    lift_priority,
    pipeline_size,
    tensor_parallel_workers,
)
from lightning_gsched.schedule.dryrun import dry_run
from lightning_gsched.schedule.jobs import StageGraph
from lightning_gsched.schedule.lazy_ranks import LazyList
from lightning_gsched.schedule.library import get_schedule, resolve_shape
from lightning_gsched.schedule.limits import check_size
from lightning_gsched.schedule.lower import Lowering, lower, programs_of
from lightning_gsched.schedule.metrics import PlanMetrics, measure
from lightning_gsched.schedule.orders import CapSpec, PriorityFn, normalise_caps, resolve_order
from lightning_gsched.schedule.placements import PlacementFn, PlacementTable
from lightning_gsched.schedule.program import Programs
from lightning_gsched.schedule.proof import certify, checked_lowering
from lightning_gsched.schedule.replicas import ReplicaLayout
from lightning_gsched.schedule.simulate import Costs, Timeline
from lightning_gsched.schedule.symmetry import make_simulator

# From this many jobs each rank's program is lowered on demand (verified: deadlock freedom proven
# from the timeline, proof.py), as by group symmetry always; below, all at once is cheap enough.
LAZY_FROM_JOBS = 1 << 18


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic collector: collecting a large plan's ~10^5 small acyclic tuples frees
    nothing and walks every object. Process-wide: two threads planning at once may re-enable it
    early, which costs time, never correctness."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class Plan:
    """Everything known about one schedule instance before anything runs."""

    schedule: str
    workers: int
    stages: int
    micro: int
    R: int | None
    order: str
    caps: list[int | None]
    costs: Costs
    table: PlacementTable
    timeline: Timeline
    programs: Programs
    metrics: PlanMetrics
    forward_only: bool = False
    # one per stage (all False when forward-only); ``costs.backward`` includes the recompute
    checkpointed: tuple[bool, ...] = ()
    fetch_window: int | None = None  # most fetched stages resident at once (None: no limit)
    # G replicas of a P = W/G-worker schedule; ``micro`` counts all G replicas' microbatches
    data_parallel_size: int = 1
    data_parallel: str = "replicate"
    # each worker is T ranks sharing its stages' layers (rank w * T + t): the programs are the
    # workers', ``workers`` = W / T of the job's W ranks
    tensor_parallel_size: int = 1

    @property
    def ranks(self) -> int:  # the job's processes: workers x T
        return self.workers * self.tensor_parallel_size

    @property
    def pipeline_size(self) -> int:  # P: the workers of one replica
        return self.workers // self.data_parallel_size

    @property
    def replicas(self) -> ReplicaLayout:  # where each replica's ranks sit (rank = p * G + g)
        return ReplicaLayout(self.pipeline_size, self.data_parallel_size)

    @property
    def ties(self) -> dict[int, tuple[int, ...]]:  # {home stage: every stage reading the tie}
        return self.programs.ties

    def to_json(self, workers: Sequence[int] | None = None) -> dict[str, Any]:
        """``gsched plan --json``. ``workers``: only their rows, each read off its own program,
        without the slots and programs (``"complete": false``), at large W minutes and GBs."""
        out = {
            "schedule": self.schedule, "forward_only": self.forward_only, "workers": self.workers,
            "data_parallel_size": self.data_parallel_size, "data_parallel": self.data_parallel,
            "pipeline_size": self.pipeline_size,
            "tensor_parallel_size": self.tensor_parallel_size, "stages": self.stages,
            "microbatches": self.micro, "R": self.R, "order": self.order, "caps": self.caps,
            "split_backward": self.programs.split_backward,
            "checkpointed": list(self.checkpointed), "fetch_window": self.fetch_window,
            "ties": {str(h): list(r) for h, r in self.ties.items()},
            "forward_costs": list(self.costs.forward),
            "backward_costs": list(self.costs.backward), "weight_costs": list(self.costs.weight),
            "latency": self.metrics.latency, "bubble_fraction": self.metrics.bubble_fraction,
            "owners": [list(o) for o in self.table.owners],
        }
        if workers is not None:
            rows = [self.metrics.per_worker[w] for w in workers]
            return {**out, "complete": False, "per_worker": [m.as_dict() for m in rows]}
        self.programs.ranks.make_all()  # every program: at once
        return {
            **out,
            "complete": True,
            "per_worker": [m.as_dict() for m in self.metrics.per_worker],
            "timeline": [
                {"worker": s.worker, "stage": s.job.stage, "micro": s.job.micro,
                 "phase": s.job.phase.value, "start": s.start, "end": s.end}
                for s in sorted(self.timeline.slots, key=lambda s: (s.worker, s.start))
            ],
            "programs": [[str(a) for a in program] for program in self.programs.ranks],
        }


def plan(
    schedule: str | None = "fslpp", workers: int = 1, stages: int | None = None,
    microbatches: int | None = None, R: int | None = None,
    order: str | PriorityFn | None = None, cap: CapSpec = DEFAULT,
    forward_cost: float | Sequence[float] = 1.0, backward_cost: float | Sequence[float] = 2.0,
    placement: PlacementFn | None = None, priority: PriorityFn | None = None,
    edges: Sequence[tuple[int, int]] | None = None, verify: bool = True,
    forward_only: bool = False, weight_cost: float | Sequence[float] | None = None,
    split_backward: bool | None = None, checkpoint_activations: bool | Sequence[bool] = False,
    fetch_window: int | None = None,
    ties: Mapping[int, Iterable[int]] | Iterable[Iterable[int]] | None = None,
    data_parallel_size: int = 1, data_parallel: str = "replicate",
    tensor_parallel_size: int = 1,
) -> Plan:
    """Build, simulate, lower, verify and measure a schedule.

    ``schedule`` names a library entry; or pass ``placement`` (and optionally ``priority``) for a
    custom schedule, ``schedule`` then being a label. ``cap="auto"``: the smallest uniform
    activation cap that keeps the uncapped latency. ``edges``: the stage graph, which must be the
    chain 0 -> 1 -> ... -> S-1 (the default) while the runtime runs chains only.
    ``forward_only=True`` plans validation/test/predict: F jobs only, on the training plan's
    placement (hence stage owners), so one executor runs both. ``split_backward``: every backward
    as B (input gradient) then W (weight gradient); None: the schedule's choice. ``weight_cost``
    is W's duration and ``backward_cost`` then B's; without it a split backward's cost is halved.
    ``checkpoint_activations``: True or one bool per stage; a checkpointed stage's F keeps only
    its inputs and its B recomputes the forward (its cost added). ``fetch_window``: the most
    fetched stages a worker holds at once (None: each fetch is posted one compute before it is
    needed). ``ties``: weights several stages read (``{home stage: reader stages}`` or stage
    groups), each a weight unit owned with its home stage (the lowest reader).
    ``data_parallel_size=G``: G replicas on P = W/G workers each, rank ``p * G + g`` being
    position p of replica g; the defaults are the P-worker ones and ``microbatches`` counts one
    replica's. ``data_parallel``: ``"replicate"`` (one gradient all-reduce per stage across the
    replicas) or ``"shard"`` (each stage owned once across its column, fetched once per step).
    ``tensor_parallel_size=T``: ``workers`` counts ranks, W = P x G x T, and each worker of the
    schedule is T consecutive ranks sharing its stages' layers (rank ``w * T + t``): the plan's
    programs, ``Plan.workers`` and every per-worker figure are the W / T workers'.

    Where the timeline is by group symmetry (:mod:`.symmetry`) or has :data:`LAZY_FROM_JOBS` jobs
    or more, and ``verify=False`` or :func:`.proof.certify` accepts it, ``programs.ranks`` and
    ``metrics.per_worker`` are made per rank when first read (:mod:`.lazy_ranks`), the same values;
    verified, deadlock freedom is proven once and each program is dry-run checked when made.
    """
    validate.positive_int("workers", workers)  # first, as before the arguments
    arguments = ScheduleArguments(
        schedule=schedule, stages=stages, microbatches=microbatches, R=R, order=order, cap=cap,
        forward_cost=forward_cost, backward_cost=backward_cost, placement=placement,
        priority=priority, weight_cost=weight_cost, split_backward=split_backward,
        checkpoint_activations=checkpoint_activations, fetch_window=fetch_window, ties=ties,
        data_parallel_size=data_parallel_size, data_parallel=data_parallel,
        tensor_parallel_size=tensor_parallel_size)
    return plan_arguments(arguments, workers, edges=edges, verify=verify, forward_only=forward_only)


def plan_arguments(arguments: ScheduleArguments, workers: int = 1, *,
                   edges: Sequence[tuple[int, int]] | None = None, verify: bool = True,
                   forward_only: bool = False) -> Plan:
    """:func:`plan` for arguments already validated (a front end's config, the CLI's)."""
    verify = validate.flag("verify", verify)
    build = _prepare(arguments, workers, edges, forward_only)[3]
    with _gc_paused():
        return build(verify)


def check_plan_arguments(arguments: ScheduleArguments, workers: int = 1, *,
                         forward_only: bool = False) -> tuple[int, int, int | None]:
    """(S, B, R) for ``workers`` ranks after every check :func:`plan_arguments` makes before it
    simulates, for a front end to run on every rank before any process talks to another. A user's
    callable fails only when called, so with one the plan is built (unverified) and dropped."""
    S, B, R, build = _prepare(arguments, workers, None, forward_only)
    a = arguments
    if a.placement is not None or any(callable(f) for f in (a.order, a.priority, a.cap)):
        with _gc_paused():
            build(False)
    return S, B, R


def resolve_arguments(arguments: ScheduleArguments, workers: int) -> tuple[int, int, int | None]:
    """(S, B, R) :func:`plan_arguments` fills in: a custom placement's own, or a library schedule's
    defaults on each replica's P = W / G workers (B per replica). Sharded, the default S grows by
    the smallest factor giving every worker a multiple of G stages, so that each rank of a column
    owns as many (1f1b at G = 2: S = 2P)."""
    a = arguments
    if a.placement is not None:
        return int(a.stages), int(a.microbatches), a.R  # type: ignore[arg-type]
    G = a.data_parallel_size
    W, P = pipeline_workers(a, workers)
    name = get_schedule(a.schedule).name  # type: ignore[arg-type]
    with _reworded(_on_replicas(P, G)):
        S, B, R = resolve_shape(name, P, a.stages, a.microbatches, a.R)
    if G > 1 and a.data_parallel == "shard" and a.stages is None:
        S *= G // math.gcd(max(1, S // P), G)
    return S, B, R


def pipeline_workers(a: ScheduleArguments, ranks: int) -> tuple[int, int]:
    """(W, P): the schedule's workers for ``ranks`` processes (W = ranks / T) and each
    replica's (P = W / G), or a :class:`ScheduleConfigError` naming what does not divide."""
    W = tensor_parallel_workers(validate.positive_int("workers", ranks), a.tensor_parallel_size)
    T = a.tensor_parallel_size
    with _reworded("" if T == 1 else f"with tensor_parallel_size={T} the schedule runs on "
                   f"W / tensor_parallel_size = {W} workers of {T} ranks each: "):
        return W, pipeline_size(W, a.data_parallel_size)


def splits_backward(a: ScheduleArguments) -> bool:
    """Whether ``a``'s plans run every backward as B then W (before ``forward_only``): the
    argument where given, else the library schedule's own choice (a custom placement: no)."""
    if a.split_backward is not None:
        return bool(a.split_backward)
    return a.placement is None and get_schedule(a.schedule).split_backward  # type: ignore[arg-type]


def _prepare(a: ScheduleArguments, workers: int, edges: Sequence[tuple[int, int]] | None,
             forward_only: bool) -> tuple[int, int, int | None, Callable[[bool], Plan]]:
    """``plan_arguments``' checks and resolution: (S, B, R) and the rest, given ``verify``."""
    W, P = pipeline_workers(a, workers)  # P: each replica's workers (W when G = 1)
    edges = validate.stage_edges(edges)
    forward_only = validate.flag("forward_only", forward_only)
    cap = None if isinstance(a.cap, str) and a.cap == "none" else a.cap
    G = a.data_parallel_size
    on_replicas = _on_replicas(P, G)
    S, B, R = resolve_arguments(a, workers)  # W / T's defaults (resolve divides by T)
    split = validate.flag("split_backward", splits_backward(a)) and not forward_only
    # the job count before anything of size W or S is built (a 1f1b cap list per worker at
    # W = 10**8 exhausted the memory before this check refused the plan)
    name = (get_schedule(a.schedule).name if a.placement is None  # type: ignore[arg-type]
            else a.schedule or "custom")
    check_size(name, W, S, B * G, 1 if forward_only else 3 if split else 2)
    if a.placement is None:
        spec = get_schedule(a.schedule)  # type: ignore[arg-type]
        library_placement = spec.make_placement(P, S, R or 1)
        with _reworded(on_replicas), _named_for(spec.name):
            library_placement.check(S, B)
        placement_fn: PlacementFn = library_placement
        order_spec = a.order if a.order is not None else (a.priority or spec.order)
        cap_spec = None if forward_only else spec.cap(P, S) if cap == DEFAULT else cap
    else:
        placement_fn = a.placement
        order_spec = a.order if a.order is not None else (a.priority or "bfs")
        cap_spec = None if cap == DEFAULT or forward_only else cap
    if G > 1:  # the P-worker schedule's placement, priority and cap, lifted to G replicas
        layout = ReplicaLayout(P, G)
        with _reworded(on_replicas):
            placement_fn = lift(placement_fn, layout, S, B, a.data_parallel)
        if callable(order_spec) or order_spec == "interleaved":  # a library name is exact
            order_spec = lift_priority(resolve_order(order_spec, P, S, B, R), G)
        if cap_spec is not None and not isinstance(cap_spec, str):  # 'auto': one uniform cap
            with _reworded(on_replicas):  # a list is per worker of each replica
                cap_spec = lift_caps(normalise_caps(cap_spec, P), layout)
        B *= G
    elif isinstance(cap_spec, (list, tuple)):  # one per worker: its length checked up front,
        normalise_caps(cap_spec, W)  # as a front end's setup runs this (it failed at the build)
    grew = a.data_parallel == "shard" and a.stages is None and a.placement is None
    # per-stage arguments against the S the plan has, which sharding may have grown
    with _reworded("", f" (data_parallel='shard' grew the schedule's default S to {S} so that "
                   "every rank of a stage's column owns as many stages; give stages= to choose S)"
                   if grew else ""):
        # forward-only plans of a split schedule share its arguments; they run no W to cost
        costs = Costs.build(S, a.forward_cost, a.backward_cost,
                            None if forward_only else a.weight_cost, split)
        checkpointed = validate.per_stage_flags("checkpoint_activations",
                                                a.checkpoint_activations, S)
        tie_map = validate.ties(a.ties, S)
    if forward_only:  # no backward: nothing is stashed, nothing recomputed
        checkpointed = (False,) * S
    costs = costs.with_recompute(checkpointed)
    require_chain(S, edges)  # the runtime runs chains only: refuse other graphs up front
    graph = StageGraph(S, edges, forward_only=forward_only, split_backward=split)
    return S, B, R, partial(_build, a, name, W, S, B, R, order_spec, cap_spec, placement_fn, costs,
                            graph, checkpointed, tie_map)


def _on_replicas(P: int, G: int) -> str:
    """With replicas, the prefix saying an error's numbers are those of each replica's schedule."""
    return "" if G == 1 else (f"with data_parallel_size={G} each replica runs the schedule on "
                              f"P = W / data_parallel_size = {P} workers: ")


@contextmanager
def _reworded(prefix: str, suffix: str = "") -> Iterator[None]:
    """A :class:`ScheduleConfigError` raised inside, reworded ``prefix`` + message + ``suffix``."""
    try:
        yield
    except ScheduleConfigError as exc:
        if not prefix and not suffix:
            raise
        raise type(exc)(f"{prefix}{exc}{suffix}") from None


@contextmanager
def _named_for(schedule: str) -> Iterator[None]:
    """A placement's refusal under the schedule's name: schedules share placements (1f1b and
    the zero-bubble ones are gpipe's, interleaved lpp's, fsdp ddp's microbatching), which name
    themselves; ``gsched plan 1f1b -s 3`` said "gpipe: ..."."""
    try:
        yield
    except ScheduleConfigError as exc:
        placement, colon, rest = str(exc).partition(": ")
        if not colon or placement == schedule or " " in placement:
            raise
        raise type(exc)(f"{schedule} (on {placement}'s placement): {rest}") from None


def _build(a: ScheduleArguments, name: str, W: int, S: int, B: int, R: int | None,
           order_spec: str | PriorityFn, cap_spec: CapSpec, placement_fn: PlacementFn,
           costs: Costs, graph: StageGraph, checkpointed: tuple[bool, ...],
           ties: dict[int, tuple[int, ...]], verify: bool) -> Plan:
    fetch_window = a.fetch_window
    priority_fn = resolve_order(order_spec, W, S, B, R)
    order_name = order_spec if isinstance(order_spec, str) else getattr(order_spec, "__name__", "custom")
    table = PlacementTable(placement_fn, W, S, B)  # both phases: owners as in training
    if table.hold_fetched_for_step and fetch_window is not None:  # data_parallel='shard'
        # a rank holds every stage it fetches at once: a smaller window cannot be met
        fetched = max((len(table.computed_stages(w) - set(table.owned_stages(w)))
                       for w in range(W)), default=0)
        if fetch_window < fetched:
            raise ScheduleConfigError(
                f"fetch_window={fetch_window} is not valid with data_parallel='shard': a rank "
                f"holds every stage it fetches for the whole step ({fetched} here), so the "
                f"window must be at least {fetched}; drop fetch_window, or use "
                "data_parallel='replicate'")
    # by group symmetry where that is exact (symmetry.py), else the full simulation
    run = make_simulator(graph, table, placement_fn, priority_fn, costs)
    if cap_spec == "auto":
        caps, timeline = auto_cap_timeline(run, table)
    elif isinstance(cap_spec, str):
        raise ScheduleConfigError(f"cap {cap_spec!r} is not understood; use an int, a list, None or 'auto'")
    else:
        caps = normalise_caps(cap_spec, W)
        try:
            timeline = run(caps)
        except CapTooSmallError as exc:
            smallest = smallest_feasible_cap(run, table)
            if a.placement is not None or a.cap != DEFAULT:
                raise CapTooSmallError(
                    f"{exc} (the smallest uniform cap that completes this schedule is {smallest})"
                ) from None
            # A schedule's default cap is a memory target, not a promise the user made: where
            # the greedy order cannot complete under it (uneven costs, S > W), the smallest
            # uniform cap that completes is the closest schedule that runs.
            caps = [smallest] * W
            timeline = run(caps)
    lazy = (timeline.replicas is not None or len(timeline.start) >= LAZY_FROM_JOBS) and (
        not verify or certify(graph, table, timeline, ties) is None)

    @_gc_paused()  # also where a lazy plan's reader of every rank calls it, after plan() returned
    def every() -> Programs:  # every rank's program at once
        full = lower(graph, table, timeline, fetch_window, ties)
        if verify:
            dry_run(full)
        return full

    if lazy:
        # each rank's program is lowered when first read (what lower() gives it), checked when
        # verified (proof.py), after plan() returned: with the collector paused, as planning is
        lowering = Lowering(graph, table, timeline, fetch_window, ties)
        one = lowering.program if not verify else checked_lowering(
            lowering, lambda ranks: programs_of(graph, table, ranks, ties))
        make = _gc_paused()(one)
        programs = programs_of(graph, table, LazyList(W, make, lambda: list(every().ranks)), ties)
    else:
        programs = every()
    metrics = measure(programs, timeline, lazy=lazy)
    return Plan(name, W, S, B, R, order_name, caps, costs, table, timeline, programs, metrics,
                graph.forward_only, checkpointed, fetch_window, a.data_parallel_size,
                a.data_parallel, a.tensor_parallel_size)

