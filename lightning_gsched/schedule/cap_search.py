"""The planner's bisections over simulations (``run(caps)``: ``symmetry.make_simulator``): the
smallest cap a schedule completes under, and ``cap="auto"``."""

from __future__ import annotations

from collections import Counter
from typing import Callable

from lightning_gsched.errors import CapTooSmallError
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.simulate import Timeline

Run = Callable[[list[int | None]], Timeline]  # a simulation under per-worker caps


def _most_jobs_per_worker(table: PlacementTable) -> int:
    """An upper end for a cap search: no worker stashes more than it computes (at least 1)."""
    return max(1, max(Counter(w for row in table.compute for w in row).values(), default=0))


def smallest_passing(low: int, high: int, ok: Callable[[int], bool]) -> int:
    """Smallest c in [low, high] with ok(c), assuming ok is monotone and ok(high)."""
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return low


def search_from(low: int, high: int, ok: Callable[[int], bool], guess: int) -> int:
    """:func:`smallest_passing`'s answer, trying ``guess`` and ``guess - 1`` first: it is often
    exactly W (1F1B-like orders stash at most W microbatch-stages per worker), so two simulations
    usually settle what a bisection takes log2(B*S/W) for."""
    guess = min(max(guess, low), high)
    if guess == high:
        return smallest_passing(low, high, ok)
    if ok(guess):
        if guess == low or not ok(guess - 1):
            return guess
        return smallest_passing(low, guess - 1, ok)
    return smallest_passing(guess + 1, high, ok)


def _simulate(run: Run, caps: list[int | None]) -> Timeline | None:
    try:
        return run(caps)
    except CapTooSmallError:
        return None


def smallest_feasible_cap(run: Run, table: PlacementTable) -> int:
    """The smallest uniform cap with which the greedy schedule completes."""
    return smallest_passing(1, _most_jobs_per_worker(table),
                            lambda c: _simulate(run, [c] * table.workers) is not None)


def auto_cap_timeline(run: Run, table: PlacementTable) -> tuple[list[int | None], Timeline]:
    """The smallest uniform cap whose latency equals the uncapped latency, and its timeline."""
    W = table.workers
    target = run([None] * W).latency
    kept: dict[int, Timeline] = {}  # the last cap that kept the latency: not simulated again

    def keeps_latency(c: int) -> bool:
        timeline = _simulate(run, [c] * W)
        if timeline is None or timeline.latency > target + 1e-9:
            return False
        kept.clear()
        kept[c] = timeline
        return True

    cap = search_from(1, _most_jobs_per_worker(table), keeps_latency, guess=W)
    return [cap] * W, kept.get(cap) or run([cap] * W)  # the upper end may be untried
