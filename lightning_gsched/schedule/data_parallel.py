"""Data parallelism as a placement: G replicas of any P-worker schedule, one renaming: microbatch
``b`` runs as ``m = b // G`` on replica ``g = b mod G`` (:class:`~.replicas.ReplicaLayout`).

- placement: compute on ``rank(w_P(s, m, d).compute, g)``. Replicated, the weights too: a stage's G
  owners are joined by the lowering's all-reduce after each one's last weight-gradient job of it.
  Sharded (the P-worker schedule owns each stage once), position ``o``'s stages are dealt round
  robin over its column, whose other ranks fetch a stage, hold it for the step (torchtitan's
  ``reshard_after_forward=False`` under a pipeline) and reduce its gradient to the owner once;
- priority: ``n(s, b, d) = n_P(s, b // G, d)``; cap: ``cap[rank(p, g)] = cap_P[p]``.

Why exact: a job's predecessors and successors are jobs of its microbatch, so on its replica's
ranks, and every rank runs one replica's jobs in the P-worker priorities' order under an
order-preserving renaming of microbatches (``m -> g + G*m``). So each replica's timeline is the
P-worker schedule's, renamed, and each rank stashes what its position stashes; only weights cross
replicas. :mod:`.symmetry` plans one replica and renames it (tests compare with the full
simulation). The looped family is this lift with replica-contiguous ranks: lpp is G replicas of an
R-worker loop, fslpp its sharded form, ddp and fsdp of one worker.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.jobs import Phase
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.orders import InterleavedOrder, PriorityFn, layout_of
from lightning_gsched.schedule.placements import LibraryPlacement, PlacementFn, PlacementTable
from lightning_gsched.schedule.replicas import ReplicaLayout

MODES = ("replicate", "shard")
# data parallel over all W ranks already: a second data-parallel dimension means nothing there
ALREADY_DATA_PARALLEL = ("ddp", "fsdp")


def takes_data_parallel() -> list[str]:
    """The library schedules that compose with ``data_parallel_size > 1``."""
    return [name for name in LIBRARY if name not in ALREADY_DATA_PARALLEL]


def check_data_parallel(schedule: str | None, size: Any, mode: Any) -> None:
    """What can be said without W. ``schedule`` is None for a custom placement."""
    G = validate.positive_int("data_parallel_size", size, "2")
    if not isinstance(mode, str) or mode not in MODES:
        raise validate.invalid(
            "data_parallel", mode, f"must be one of {list(MODES)} (each replica holds its "
            "stages, or each stage is owned once across its column of replicas)", "'shard'")
    if G > 1 and schedule in ALREADY_DATA_PARALLEL:
        raise ScheduleConfigError(
            f"schedule {schedule!r} is data parallel over all W ranks already, so "
            f"data_parallel_size={G} has nothing to compose with; use data_parallel_size=1, or a "
            f"pipeline schedule that takes it: {', '.join(takes_data_parallel())}")
    if mode == "shard" and G == 1:
        raise ScheduleConfigError(
            "data_parallel='shard' shards each stage over the data-parallel replicas, and "
            "data_parallel_size=1 has one replica: set data_parallel_size to 2 or more, or use "
            "fsdp or fslpp to shard without replicas")


def tensor_parallel_workers(ranks: int, tensor_parallel_size: int) -> int:
    """The schedule's workers when each is a group of T = ``tensor_parallel_size`` ranks (rank
    ``w * T + t``): W / T, or a :class:`ScheduleConfigError` naming the divisors of W."""
    T = tensor_parallel_size
    if ranks % T:
        raise ScheduleConfigError(
            f"tensor_parallel_size={T} does not divide the W={ranks} ranks (num_nodes x "
            f"devices); each pipeline worker is T ranks that share its stages' layers. Choose "
            f"tensor_parallel_size among {[d for d in range(1, ranks + 1) if ranks % d == 0]}")
    return ranks // T


def pipeline_size(workers: int, replicas: int) -> int:
    """P = W / G, or a :class:`ScheduleConfigError` naming the divisors of W."""
    if workers % replicas:
        raise ScheduleConfigError(
            f"data_parallel_size={replicas} does not divide the W={workers} workers (num_nodes x "
            f"devices, over tensor_parallel_size where it is above 1); each replica runs the "
            f"schedule on W / data_parallel_size workers. Choose data_parallel_size among "
            f"{[d for d in range(1, workers + 1) if workers % d == 0]}")
    return workers // replicas


@dataclass(frozen=True)
class DataParallel(LibraryPlacement):
    """G replicas of the P-worker placement ``inner``; built by :func:`lift`, which validates
    ``inner`` (a valid inner placement makes a valid lift) and deals the shard mode's owners."""

    inner: PlacementFn
    layout: ReplicaLayout
    owners: tuple[int, ...] | None = None  # shard: each stage's owning rank; None: replicate

    @property
    def shard(self) -> bool:
        """Sharded: one owner per stage (so its row of weights workers is constant in the
        microbatch), and a fetched stage is held from its first job of the step to its last."""
        return self.owners is not None

    hold_fetched_for_step = weights_constant_in_micro = shard

    @property
    def reserves_stash(self) -> bool:  # the P-worker schedule's cap rule (reserve.py), lifted
        return bool(getattr(self.inner, "reserves_stash", False))

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int]:
        replica, m = micro % self.layout.replicas, micro // self.layout.replicas
        weights, compute = self.inner(stage, m, phase)
        if self.owners is not None:
            return self.owners[stage], self.layout.rank(compute, replica)
        return self.layout.rank(weights, replica), self.layout.rank(compute, replica)

    def _inner_library(self) -> LibraryPlacement | None:
        return self.inner if isinstance(self.inner, LibraryPlacement) else None

    def weights_key(self, stage: int) -> Hashable:  # equal inner rows are renamed alike
        inner = self._inner_library()
        return stage if self.owners is not None or inner is None else inner.weights_key(stage)

    def compute_key(self, stage: int) -> Hashable:
        inner = self._inner_library()
        return stage if inner is None else inner.compute_key(stage)

    def micro_period(self) -> int | None:
        """The inner rows' period (1 where they do not depend on the microbatch) times G."""
        inner = self._inner_library()
        if inner is None:
            return None
        period = inner.micro_period()
        if period is None and inner.compute_constant_in_micro and inner.weights_constant_in_micro:
            period = 1
        return None if period is None else period * self.layout.replicas

    def check(self, stages: int, micro: int) -> None:
        """Checked by :func:`lift` already (the inner placement on its P workers)."""


def lift(inner: PlacementFn, layout: ReplicaLayout, stages: int, micro_per_replica: int,
         mode: str = "replicate") -> DataParallel:
    """The G-replica placement of ``inner``, validated on its own P workers (so an error names
    the P-worker job). Shard mode needs one owner per stage in ``inner``."""
    table = PlacementTable(inner, layout.pipeline, stages, micro_per_replica)
    if mode == "replicate":
        return DataParallel(inner, layout)
    s = next((s for s, owners in enumerate(table.owners) if len(owners) != 1), None)
    if s is not None:
        raise ScheduleConfigError(
            f"data_parallel='shard' needs a schedule that owns each stage once per replica, "
            f"but stage {s} has {len(table.owners[s])} owners in the {layout.pipeline}-worker "
            "schedule (lpp replicates its stages over its groups): use data_parallel="
            "'replicate', or fslpp (lpp with each stage owned once)")
    dealt = {p: itertools.count() for (p,) in table.owners}  # numbers each position's stages
    owners = tuple(layout.rank(p, next(dealt[p]) % layout.replicas) for (p,) in table.owners)
    return DataParallel(inner, layout, owners)


class LiftedPriority:
    """``n(s, b, d) = n_P(s, b // G, d)``: a P-worker priority read through the renaming."""

    def __init__(self, inner: PriorityFn, replicas: int) -> None:
        self.inner, self.replicas = inner, replicas
        self.__name__ = getattr(inner, "__name__", "custom")

    def __call__(self, stage: int, micro: int, phase: Phase) -> Any:
        return self.inner(stage, micro // self.replicas, phase)

    def __repr__(self) -> str:
        return f"<{self.__name__} of each of {self.replicas} replicas>"


def lift_priority(priority: PriorityFn, replicas: int) -> PriorityFn:
    """A library order (bfs, gpipe, 1f1b, zb) is returned as is: its microbatch loops are
    monotone in b, so on every rank (microbatches ``g + G*m``) it orders jobs as ``n_P(s, m, d)``
    does, and the fast paths keep its layout."""
    if replicas == 1 or layout_of(priority) is not None:
        return priority
    if isinstance(priority, InterleavedOrder):
        return priority.with_replicas(replicas)
    return LiftedPriority(priority, replicas)


def replica_priority(priority: PriorityFn, replicas: int) -> PriorityFn | None:
    """The P-worker priority that :func:`lift_priority` lifted to ``priority``, or None when
    ``priority`` is not such a lift (then no replica can be planned alone)."""
    if layout_of(priority) is not None:
        return priority
    if isinstance(priority, InterleavedOrder) and priority.replicas == replicas:
        return priority.with_replicas(1)
    if isinstance(priority, LiftedPriority) and priority.replicas == replicas:
        return priority.inner
    return None


def lift_caps(caps: Sequence[int | None], layout: ReplicaLayout) -> list[int | None]:
    """One cap per rank: position p's cap (of P) in every replica."""
    return [caps[layout.position(rank)] for rank in range(layout.workers)]
