"""The planner's search for caps: the smallest cap a schedule completes under, and ``cap="auto"``.

Why a module of its own: both are bisections over simulations (each ``run(caps)`` one timeline,
by symmetry, a sweep or in full: ``symmetry.make_simulator``), a question of their own beside
building a plan; :func:`.plan.plan` asks them where a cap is ``"auto"`` or a schedule's default
cap cannot complete. Pure Python.
"""

from __future__ import annotations

from typing import Callable

from lightning_gsched.errors import CapTooSmallError
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.simulate import Timeline


def _jobs_per_worker(table: PlacementTable) -> list[int]:
    counts = [0] * table.workers
    for s in range(table.stages):
        for b in range(table.micro):
            counts[table.compute[s][b]] += 1
    return counts


def _bisect(low: int, high: int, ok: Callable[[int], bool]) -> int:
    """Smallest c in [low, high] with ok(c), assuming ok is monotone and ok(high)."""
    while low < high:
        mid = (low + high) // 2
        if ok(mid):
            high = mid
        else:
            low = mid + 1
    return low


def _search_from(low: int, high: int, ok: Callable[[int], bool], guess: int) -> int:
    """:func:`_bisect`'s answer, trying ``guess`` and ``guess - 1`` first.

    The smallest cap that keeps a schedule's latency is often exactly W (1F1B-like orders
    stash at most W microbatch-stages per worker), so two simulations usually settle it where a
    bisection over [1, jobs per worker] takes log2(B*S/W) of them; with a monotone ``ok`` the
    answer is the same either way.
    """
    guess = min(max(guess, low), high)
    if guess == high:
        return _bisect(low, high, ok)
    if ok(guess):
        if guess == low or not ok(guess - 1):
            return guess
        return _bisect(low, guess - 1, ok)
    return _bisect(guess + 1, high, ok)


def smallest_feasible_cap(run: Callable[[list[int | None]], Timeline],
                           table: PlacementTable) -> int:
    """The smallest uniform cap with which the greedy schedule completes (bisection);
    ``run(caps)`` simulates (by symmetry, a sweep or in full: ``symmetry.make_simulator``)."""

    def completes(c: int) -> bool:
        try:
            run([c] * table.workers)
            return True
        except CapTooSmallError:
            return False

    return _bisect(1, max(1, max(_jobs_per_worker(table))), completes)


def auto_cap_timeline(run: Callable[[list[int | None]], Timeline],
                       table: PlacementTable) -> tuple[list[int | None], Timeline]:
    """The smallest uniform cap whose latency equals the uncapped latency (bisection), and the
    timeline simulated with it (the bisection already simulated it: the last cap that kept the
    latency); ``run(caps)`` simulates as for :func:`smallest_feasible_cap`."""
    W = table.workers
    target = run([None] * W).latency
    kept: dict[int, Timeline] = {}  # the last cap that kept the latency, and its timeline

    def keeps_latency(c: int) -> bool:
        try:
            timeline = run([c] * W)
        except CapTooSmallError:
            return False
        if timeline.latency <= target + 1e-9:
            kept.clear()
            kept[c] = timeline
            return True
        return False

    cap = _search_from(1, max(1, max(_jobs_per_worker(table))), keeps_latency, guess=W)
    timeline = kept.get(cap)
    if timeline is None:  # the upper end, never tried: simulate it
        timeline = run([cap] * W)
    return [cap] * W, timeline
