"""Orders ``n(s, b, d)`` (smaller = more urgent) and per-worker activation caps. An order only
breaks ties between jobs a worker could start at once, so it cannot bound memory: a cap does,
the most stashes a worker may hold. 1F1B is "backward first" plus a cap."""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import numpy as np

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.jobs import Phase

PriorityFn = Callable[[int, int, Phase], Any]
_F, _B, _W = Phase.F, Phase.B, Phase.W  # module constants: enum member look-ups are slow
CapSpec = Union[None, int, str, Sequence[Union[int, None]], Callable[[int], Union[int, None]]]


# A library order is written once, as a layout: groups of phases in key order; within a group,
# (stage, micro) by a major and a minor loop (which index, ascending?), then the job's own
# tie-break. LibraryOrder derives n(s, b, d) from it, priorities.order_keys every key at once.
Loop = tuple[str, bool]  # ("stage" or "micro", ascending)
OrderLayout = tuple[tuple[frozenset[Phase], Loop, Loop], ...]
_STAGE_UP, _STAGE_DOWN, _MICRO_UP = ("stage", True), ("stage", False), ("micro", True)


class LibraryOrder:
    """``n(s, b, d)`` = (the phase's group, its major index, its minor index), an index negated
    where its loop descends."""

    def __init__(self, name: str, layout: OrderLayout, doc: str) -> None:
        self.__name__ = self.name = name
        self.__doc__, self.layout = doc, layout
        self._keys = {phase: (group, major, minor)
                      for group, (phases, major, minor) in enumerate(layout) for phase in phases}

    def __call__(self, stage: int, micro: int, phase: Phase) -> tuple[int, int, int]:
        group, major, minor = self._keys[phase]
        return (group, _index(major, stage, micro), _index(minor, stage, micro))

    def __repr__(self) -> str:
        return f"<library order {self.name}>"


def _index(loop: Loop, stage: int, micro: int) -> int:
    value = stage if loop[0] == "stage" else micro
    return value if loop[1] else -value


bfs = LibraryOrder("bfs", (
    (frozenset({_F}), _STAGE_UP, _MICRO_UP),  # (0, stage, micro)
    (frozenset({_B, _W}), _STAGE_DOWN, _MICRO_UP)),  # (1, -stage, micro)
    """Breadth-first (GPipe, looped BFS): all forwards before backwards, stage-major. A looped
    worker finishes stage s for every microbatch before its next stage, so fetched weights stay
    resident over a whole run of microbatches.""")

gpipe = LibraryOrder("gpipe", (
    (frozenset({_F}), _MICRO_UP, _STAGE_UP),  # (0, micro, stage)
    (frozenset({_B, _W}), _MICRO_UP, _STAGE_DOWN)),  # (1, micro, -stage)
    """GPipe's order: all forwards before backwards, microbatch-major. A worker holding several
    consecutive stages (S > W) passes a microbatch through all of them before the next, so the
    next worker gets work as early as possible; with one stage per worker it is :data:`bfs`.""")

one_f_one_b = LibraryOrder("one_f_one_b", (
    (frozenset({_B}), _MICRO_UP, _STAGE_DOWN),  # (0, micro, -stage)
    (frozenset({_F, _W}), _MICRO_UP, _STAGE_DOWN)),  # (1, micro, -stage)
    """Depth-first / 1F1B: backward first, then the oldest microbatch, deepest stage first.""")

zero_bubble = LibraryOrder("zero_bubble", (
    (frozenset({_B}), _MICRO_UP, _STAGE_DOWN),  # (0, micro, -stage)
    (frozenset({_F}), _MICRO_UP, _STAGE_DOWN),  # (1, micro, -stage)
    (frozenset({_W}), _MICRO_UP, _STAGE_DOWN)),  # (2, micro, -stage)
    """Zero bubble: 1F1B's order with every W last. B first (the previous stage waits for its
    input gradient), then F, oldest microbatch and deepest stage first; W (needed by nobody
    before the optimizer step) only when neither is startable or the cap stops the next F (a W
    frees a stash, so it also lets the pipeline go on under a cap).""")


def layout_of(priority: object) -> OrderLayout | None:
    """The layout of a library order, else None (a user's order is called per job)."""
    return priority.layout if isinstance(priority, LibraryOrder) else None


def interleaved_sequence(workers: int, stages: int, micro: int,
                         R: int) -> dict[tuple[int, int, Phase], int]:
    """Position of every job in its worker's Megatron interleaved 1F1B sequence: the order's
    written-out definition (tests check :class:`InterleavedOrder` against it). Worker ``g*R +
    p`` of a looped placement runs stages ``c*R + p`` of the microbatches ``b mod G == g``, its
    chunks depth-first over groups of R microbatches: a warm-up of ``2*(R-p-1) + (v-1)*R``
    forwards (v = S/R chunks), then one forward and one backward alternately."""
    groups, chunks = workers // R, stages // R
    position: dict[tuple[int, int, Phase], int] = {}
    for worker in range(workers):
        g, p = divmod(worker, R)
        mine = [b for b in range(micro) if b % groups == g]
        blocks = [mine[first:first + R] for first in range(0, len(mine), R)]
        forwards = [(c * R + p, b, _F) for block in blocks for c in range(chunks) for b in block]
        backwards = [(c * R + p, b, _B) for block in blocks for c in reversed(range(chunks))
                     for b in block]
        warmup = min(2 * (R - p - 1) + (chunks - 1) * R, len(forwards))
        sequence = forwards[:warmup]
        for k in range(len(forwards) - warmup):
            sequence += [forwards[warmup + k], backwards[k]]
        sequence += backwards[len(forwards) - warmup:]
        position.update((job, index) for index, job in enumerate(sequence))
    return position


class InterleavedOrder:
    """Priority = position in :func:`interleaved_sequence`, by formula (a table would not fit
    at large W). ``replicas``: G data-parallel replicas of this order (microbatch b is replica b
    mod G's b // G; ``micro`` is per replica)."""

    __name__ = "interleaved"

    def __init__(self, workers: int, stages: int, micro: int, R: int, replicas: int = 1) -> None:
        self.workers, self.stages, self.micro, self.R = workers, stages, micro, R
        self.replicas = replicas

    def with_replicas(self, replicas: int) -> InterleavedOrder:
        return InterleavedOrder(self.workers, self.stages, self.micro, self.R, replicas)

    def __call__(self, stage: int, micro: int, phase: Phase) -> int:
        return int(self.positions(np.array([stage]), np.array([micro]),
                                  np.array([phase is not _F]))[0])

    def __repr__(self) -> str:
        replicas = f" x {self.replicas} replicas" if self.replicas > 1 else ""
        return (f"<interleaved order W={self.workers} S={self.stages} B={self.micro} "
                f"R={self.R}{replicas}>")

    def positions(self, stage: np.ndarray, micro: np.ndarray, backward: np.ndarray) -> np.ndarray:
        """Positions of jobs (arrays of stage, microbatch, is-backward) in their worker's
        sequence: :func:`interleaved_sequence`'s loops solved for the index."""
        R, G, V = self.R, self.workers // self.R, self.stages // self.R
        micro = micro // self.replicas  # the replica's own microbatch
        g, p, c = micro % G, stage % R, stage // R
        m = micro // G  # the microbatch's place among its group's (b = g + m * G)
        mine = (self.micro - g + G - 1) // G
        block, within = m // R, m % R
        size = np.minimum(R, mine - block * R)  # the last block may be short
        chunk = np.where(backward, V - 1 - c, c)
        index = block * V * R + chunk * size + within  # in the forward (backward) order
        forwards = mine * V
        warmup = np.minimum(2 * (R - p - 1) + (V - 1) * R, forwards)
        forward_at = np.where(index < warmup, index, 2 * index - warmup)
        backward_at = np.where(index < forwards - warmup, warmup + 2 * index + 1, forwards + index)
        positions: np.ndarray = np.where(backward, backward_at, forward_at)
        return positions


def interleaved_order(workers: int, stages: int, micro: int, R: int) -> PriorityFn:
    if R is None or workers % R or stages % R:
        raise ScheduleConfigError(
            "order 'interleaved' needs a looped placement with W and S multiples of R "
            f"(got W={workers}, S={stages}, R={R}); use order '1f1b' for other placements")
    return InterleavedOrder(workers, stages, micro, R)


ORDERS: dict[str, PriorityFn] = {"bfs": bfs, "gpipe": gpipe, "1f1b": one_f_one_b,
                                  "dfs": one_f_one_b, "zb": zero_bubble}
ORDER_NAMES = sorted([*ORDERS, "interleaved"])


def check_order(order: object) -> None:
    """An order argument is None (the schedule's), a known name or a callable ``n(s, b, d)``."""
    if not (order is None or callable(order) or (isinstance(order, str) and order in ORDER_NAMES)):
        raise ScheduleConfigError(
            f"order={order!r} is not valid: unknown order {order!r}; use one of {ORDER_NAMES} or "
            "a callable n(s, b, d), e.g. order='1f1b'")


def resolve_order(order: str | PriorityFn, workers: int = 1, stages: int = 1, micro: int = 1,
                  R: int | None = None) -> PriorityFn:
    check_order(order)
    if callable(order):
        return order
    if order == "interleaved":
        return interleaved_order(workers, stages, micro, R if R is not None else workers)
    return ORDERS[order]


def one_f_one_b_caps(workers: int, stages: int | None = None) -> list[int]:
    """The classic 1F1B bound: worker r of a W-deep pipeline holds at most W - r microbatches,
    k * (W - r) stashes for k = S/W consecutive stages per worker."""
    per_micro = max(1, (stages or workers) // workers)
    return [per_micro * (workers - r) for r in range(workers)]


def normalise_caps(cap: CapSpec, workers: int) -> list[int | None]:
    """One cap per worker (None: unbounded). ``"auto"`` is the planner's (it needs simulations)."""
    if cap is None:
        return [None] * workers
    if isinstance(cap, str):
        raise ScheduleConfigError(f"cap {cap!r} must be resolved by the planner before simulation")
    if callable(cap):
        caps = []
        for w in range(workers):
            try:  # a failure inside the user's cap names the callable and the worker
                caps.append(cap(w))
            except Exception as exc:  # noqa: BLE001 - any failure inside the user's cap(w)
                raise validate.user_callable_error("cap", cap, (w,), "w", exc) from exc
    elif isinstance(cap, int):
        caps = [cap] * workers
    else:
        validate.cap_form(cap, ())
        caps = list(cap)
        if len(caps) != workers:
            raise ScheduleConfigError(
                f"cap list has {len(caps)} entries but there are W={workers} workers; give one "
                "cap per worker, a single int, or None (uncapped)")
    return [validate.cap_entry(w, c) for w, c in enumerate(caps)]
