"""Placements ``w(s, b, d) -> (weights_worker, compute_worker)``: which worker computes each job
and which holds the source of truth of its stage's weights (lowering derives all traffic).
The named ones generalise the seed's ``W = B`` and ``W = S`` to multiples; any callable is a
placement too, validated once by :class:`PlacementTable`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable, cast

from lightning_gsched.errors import PlacementError, ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.jobs import Phase

PlacementFn = Callable[[int, int, Phase], "tuple[int, int]"]
_F = Phase.F  # a module constant: an enum member look-up is slow, and rows() reads it per call
# classes whose rows are trusted unvalidated: the library's, not a user's subclass (its __call__)
_LIBRARY: set[type] = set()


class LibraryPlacement:
    """A library placement: ``w(s, b, d)`` (its one formula), :meth:`check` of the sizes its
    layout needs, and claims on its rows (stages with equal ``weights_key``/``compute_key``
    share a row; rows constant or periodic in b), so :meth:`rows` calls ``__call__`` once per
    distinct entry, not S x B times (tests/test_schedule_fast_paths.py checks the claims)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith("lightning_gsched.schedule."):
            _LIBRARY.add(cls)

    # a stage's weights (compute) worker is the same for every microbatch
    weights_constant_in_micro: ClassVar[bool] = False
    compute_constant_in_micro: ClassVar[bool] = False

    def micro_period(self) -> int | None:
        """Every row's period in the microbatch (None: no such claim)."""
        return None

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int]:
        raise NotImplementedError

    def check(self, stages: int, micro: int) -> None:
        raise NotImplementedError

    def weights_key(self, stage: int) -> Hashable:
        return stage

    compute_key = weights_key

    def rows(self, stages: int, micro: int) -> tuple[list[list[int]], list[list[int]]]:
        """(weights, compute) workers by stage and microbatch."""
        rows: tuple[list[list[int]], list[list[int]]] = ([], [])
        seen: dict[tuple[int, Hashable], list[int]] = {}
        for s in range(stages):
            for which, key, constant in ((0, self.weights_key(s), self.weights_constant_in_micro),
                                         (1, self.compute_key(s), self.compute_constant_in_micro)):
                row = seen.get((which, key))
                if row is None:
                    period = 1 if constant else min(self.micro_period() or micro, micro)
                    first = [self(s, b, _F)[which] for b in range(period)]
                    row = seen[(which, key)] = (first * -(-micro // period))[:micro]
                rows[which].append(row[:])  # each stage its own list, as a per-job table's
        return rows


def _multiple(value: int, of: int, message: str, label: str) -> None:
    """Require ``value`` to be a multiple of ``of``; the error suggests the next positive one."""
    if value % of:
        raise ScheduleConfigError(f"{message}; use {label}={of * max(1, -(-value // of))}")


@dataclass(frozen=True)
class DDP(LibraryPlacement):
    """w = (b mod W, b mod W): each worker runs whole microbatches with its own weight replica."""

    workers: int

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int]:
        worker = micro % self.workers
        return worker, worker

    def weights_key(self, stage: int) -> Hashable:
        return 0  # every stage: the same replicas

    compute_key = weights_key

    def micro_period(self) -> int | None:
        return self.workers

    def check(self, stages: int, micro: int) -> None:
        _multiple(micro, self.workers, f"ddp: microbatches B={micro} must be a multiple of "
                  f"workers W={self.workers}", "B")


@dataclass(frozen=True)
class FSDP(DDP):
    """w = (s mod W, b mod W): DDP's compute, but stage s's weights live only on worker s mod W."""

    weights_constant_in_micro = True  # one owner per stage

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int]:
        return stage % self.workers, micro % self.workers

    def weights_key(self, stage: int) -> Hashable:
        return stage

    def check(self, stages: int, micro: int) -> None:
        super().check(stages, micro)
        _multiple(stages, self.workers, f"fsdp: stages S={stages} must be a multiple of workers "
                  f"W={self.workers} so every worker owns S/W stages", "S")


@dataclass(frozen=True)
class GPipe(LibraryPlacement):
    """w = (k(s), k(s)), every stage computed where its weights live (which never move), with
    k = s // (S/W): contiguous blocks of stages per worker, no looping."""

    workers: int
    stages: int
    weights_constant_in_micro = compute_constant_in_micro = True

    def worker_of(self, stage: int) -> int:
        return stage // (self.stages // self.workers)

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int]:
        worker = self.worker_of(stage)
        return worker, worker

    def check(self, stages: int, micro: int) -> None:
        if stages < self.workers or stages % self.workers:
            raise ScheduleConfigError(f"gpipe: stages S={stages} must be a positive multiple of "
                                      f"workers W={self.workers} (S < W leaves workers idle); use "
                                      f"S={self.workers}")


@dataclass(frozen=True)
class VShape(GPipe):
    """GPipe's pinning with the stages in a V: k(s) = s for s < W, 2W-1-s after (S = 2kW repeats
    it). The first and last stage live on worker 0, so the loss is computed where the pipeline
    started (ZB-V)."""

    reserves_stash: bool = False

    def worker_of(self, stage: int) -> int:
        position = stage % (2 * self.workers)
        return position if position < self.workers else 2 * self.workers - 1 - position

    def check(self, stages: int, micro: int) -> None:
        _multiple(stages, 2 * self.workers, f"a V placement (zbv, v-half, v-min): stages "
                  f"S={stages} must be a positive multiple of 2W={2 * self.workers} (each worker "
                  "holds one stage on the way down and one on the way up)", "S")


@dataclass(frozen=True)
class _Looped(LibraryPlacement):
    """The seed's looped compute h(s, b) = (R*b mod W) + (s mod R): W = G*R workers form G
    groups of R; group b mod G runs microbatch b, and worker r of a group runs every stage s
    with s mod R == r. Subclasses differ in where the weights live."""

    workers: int
    R: int
    name: ClassVar[str]

    def h(self, stage: int, micro: int) -> int:
        return (self.R * micro) % self.workers + stage % self.R

    def compute_key(self, stage: int) -> Hashable:
        return stage % self.R  # h depends on s through s mod R only

    def micro_period(self) -> int | None:
        return self.workers // self.R  # and on b through R*b mod W: period G

    def check(self, stages: int, micro: int) -> None:
        name, workers, R = self.name, self.workers, self.R
        if not validate.is_int(R) or R < 1:  # True is an int to isinstance
            raise ScheduleConfigError(f"{name}: R must be a positive integer, got {R!r}")
        if workers % R:
            divisors = [r for r in range(1, workers + 1) if workers % r == 0]
            raise ScheduleConfigError(f"{name}: R={R} does not divide the number of workers "
                                      f"W={workers}; choose R among {divisors}")
        groups = workers // R
        _multiple(stages, R, f"{name}: stages S={stages} must be a multiple of R={R} so that each "
                  "worker of a group holds S/R stages", "S")
        _multiple(micro, groups, f"{name}: microbatches B={micro} must be a multiple of the number "
                  f"of groups G=W/R={groups}", "B")


class LPP(_Looped):
    """The seed's looped pipeline: w = (h(s,b), h(s,b)). R=1 is DDP, R=W (with S=W) is GPipe."""

    name = "lpp"

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int]:
        worker = self.h(stage, micro)
        return worker, worker

    weights_key = _Looped.compute_key  # its weights live where it computes


class FSLPP(_Looped):
    """Fully sharded looped pipeline: LPP's compute, one owner per stage among its computing
    workers, cycling over groups: owner(s) = R*((s // R) mod G) + (s mod R), at most ceil(S/W)
    stages per worker (unlike the seed's literal h(s, s))."""

    name = "fslpp"
    weights_constant_in_micro = True

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int]:
        owner = self.R * ((stage // self.R) % (self.workers // self.R)) + stage % self.R
        return owner, self.h(stage, micro)


class FSLPPSeed(_Looped):
    """The seed's literal FSLPP: w = (h(s, s), h(s, b)). Concentrates ownership (see docs)."""

    name = "fslpp-seed"
    weights_constant_in_micro = True

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int]:
        return self.h(stage, stage), self.h(stage, micro)


# the classes whose compute splits into W/R identical groups (symmetry.py; ddp and fsdp: R = 1)
LOOPED = frozenset({DDP, FSDP, LPP, FSLPP, FSLPPSeed})


class PlacementTable:
    """A placement evaluated once for every (s, b), validated (a :class:`PlacementError` names
    the job): workers are ints in [0, W); F and B of one (s, b) run on one compute worker (the
    stash lives there); a compute worker fetches stage s from, and returns its gradient to, a
    single owner (``fetch_source``). ``weights[s][b]``: (F's, B's) weights worker."""

    def __init__(self, placement: PlacementFn, workers: int, stages: int, micro: int) -> None:
        self.workers, self.stages, self.micro = workers, stages, micro
        self._owned: dict[int, list[int]] | None = None
        self._computed: dict[int, set[int]] | None = None
        # the lowering holds a fetched stage for the whole step (data_parallel='shard')
        self.hold_fetched_for_step = bool(getattr(placement, "hold_fetched_for_step", False))
        self.reserves_stash = bool(getattr(placement, "reserves_stash", False))
        if type(placement) in _LIBRARY:  # valid by construction: read its rows
            library = cast(LibraryPlacement, placement)
            weight_rows, self.compute = library.rows(stages, micro)
            pairs = {w: (w, w) for w in range(workers)}  # one tuple per worker, shared by rows
            self.weights = [list(map(pairs.__getitem__, row)) for row in weight_rows]
            # rows repeat with the placement's period: its first period holds every value (one
            # column where neither worker depends on b: at W=1024, 4 million pairs less to scan)
            period = (1 if library.weights_constant_in_micro and library.compute_constant_in_micro
                      else min(library.micro_period() or micro, micro))
            self.owners = [tuple(sorted(set(row[:period]))) for row in weight_rows]
            self.fetch_source = {
                (s, c): w for s in range(stages)
                for c, w in set(zip(self.compute[s][:period], weight_rows[s][:period],
                                    strict=True)) if c != w}
            return
        self.compute = [[0] * micro for _ in range(stages)]
        self.weights = [[(0, 0)] * micro for _ in range(stages)]
        source: dict[tuple[int, int], tuple[int, int, Phase]] = {}
        F, B = Phase.F, Phase.B  # locals: enum member look-ups are slow
        for s in range(stages):
            for b in range(micro):
                (wf, cf) = self._call(placement, s, b, F)
                (wb, cb) = self._call(placement, s, b, B)
                if cf != cb:
                    raise PlacementError(
                        f"placement puts F s{s} b{b} on worker {cf} but B s{s} b{b} on worker {cb}; "
                        "the backward needs the activations stashed by its forward, so both "
                        "phases of one (stage, microbatch) must use the same compute worker")
                self.compute[s][b] = cf
                self.weights[s][b] = (wf, wb)
                for w, d in ((wf, F), (wb, B)):
                    if w == cf:
                        continue
                    first = source.setdefault((s, cf), (w, b, d))
                    if first[0] != w:
                        raise PlacementError(
                            f"worker {cf} computes stage {s} with weights from worker {first[0]} "
                            f"({first[2].value} b{first[1]}) and from worker {w} ({d.value} b{b}); "
                            "a compute worker must fetch a stage from a single owner")
        self.owners = [tuple(sorted({w for pair in row for w in pair})) for row in self.weights]
        self.fetch_source = {k: v[0] for k, v in source.items()}

    def _call(self, placement: PlacementFn, s: int, b: int, d: Phase) -> tuple[int, int]:
        try:
            result = placement(s, b, d)
        except Exception as exc:  # noqa: BLE001 - any failure inside the user's w(s, b, d)
            raise validate.user_callable_error(
                "placement", placement, (s, b, d), "s, b, d", exc) from exc
        try:
            weights, compute = result
        except (TypeError, ValueError) as exc:
            raise PlacementError(
                f"placement(s={s}, b={b}, d={d.value}) must return a pair "
                f"(weights_worker, compute_worker) of ints; it failed with: {exc}") from exc
        for label, w in (("weights", weights), ("compute", compute)):
            if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < self.workers:
                raise PlacementError(
                    f"placement(s={s}, b={b}, d={d.value}) returned {label} worker {w!r}; "
                    f"workers must be ints in [0, {self.workers}) for W={self.workers}")
        return weights, compute

    # indexes built on first use: a scan of all stages per worker would be O(W x S)
    def owned_stages(self, worker: int) -> list[int]:
        if self._owned is None:
            self._owned = {}
            for s, owners in enumerate(self.owners):
                for w in owners:
                    self._owned.setdefault(w, []).append(s)
        return list(self._owned.get(worker, ()))

    def computed_stages(self, worker: int) -> set[int]:
        """The stages ``worker`` computes for some microbatch."""
        if self._computed is None:
            self._computed = {}
            for s, row in enumerate(self.compute):
                for w in set(row):
                    self._computed.setdefault(w, set()).add(s)
        return self._computed.get(worker, set())
