"""Linear partition of a sequence of unit costs into contiguous segments (pure Python).

* :func:`bottleneck` — the smallest achievable cost of the most expensive segment (bisection on
  the answer with a greedy feasibility check; exact for integer costs).
* :func:`cheapest_split` — among splits whose every segment cost lies within bounds, the one with
  the lexicographically smallest summed cut penalty (tuples, e.g. nesting depth, bytes crossing,
  values crossing), then with cuts closest to the ideal equal-cost positions ``k * total / S``.
  It is a layered shortest path whose window of feasible segment starts slides monotonically
  (both bounds move right as the segment end does),
  so a monotonic deque makes it O(S * n).

Both are deterministic — on equal scores the later segment start wins — so every rank that runs
them on the same costs gets the same cuts.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

Number = float  # ints are fine too (and exact)


def _prefix(costs: Sequence[Number]) -> list[Number]:
    sums: list[Number] = [0]
    for cost in costs:
        if cost < 0:
            raise ValueError(f"unit costs must be >= 0, got {cost!r}")
        sums.append(sums[-1] + cost)
    return sums


def _segments_needed(costs: Sequence[Number], bound: Number) -> float:
    """Fewest segments with every segment <= bound (``inf`` if one unit alone exceeds it)."""
    count = 1
    current: Number = 0  # an int for int costs (exact)
    for cost in costs:
        if cost > bound:
            return math.inf
        if current + cost > bound:
            count, current = count + 1, cost
        else:
            current += cost
    return count


def bottleneck(costs: Sequence[Number], num_segments: int) -> Number:
    """Minimal max segment cost over splits into ``num_segments`` non-empty segments."""
    n = len(costs)
    if num_segments < 1 or num_segments > max(n, 1):
        raise ValueError(f"cannot split {n} units into {num_segments} non-empty segments")
    _prefix(costs)  # validates
    if n == 0:
        return 0
    middle: Number
    low, high = max(costs), sum(costs)  # answer lies in [low, high]; splitting never raises max
    if all(float(c).is_integer() for c in costs):
        low, high = int(low), int(high)
        while low < high:
            middle = (low + high) // 2
            if _segments_needed(costs, middle) <= num_segments:
                high = middle
            else:
                low = middle + 1
        return high
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if _segments_needed(costs, middle) <= num_segments:
            high = middle
        else:
            low = middle
    return high


def cheapest_split(
    costs: Sequence[Number],
    num_segments: int,
    bound: Number,
    penalties: Sequence[tuple[Number, ...]],
    lower: Number = 0,
) -> list[int]:
    """Cut positions (``num_segments - 1`` of them, increasing) of the best split within bounds.

    Every segment must cost between ``lower`` and ``bound``. Cut ``c`` (``0 < c < n``) starts a
    segment at unit ``c``; ``penalties[c]`` is the tuple cost of cutting there (all the same
    length; index 0 is unused). Raises ``ValueError`` if no split fits the bounds.
    """
    n = len(costs)
    prefix = _prefix(costs)
    if num_segments == 1:
        if prefix[n] > bound + 1e-9 * abs(bound) or prefix[n] < lower - 1e-9 * abs(lower):
            raise ValueError(f"one segment costs {prefix[n]}, outside [{lower}, {bound}]")
        return []
    limit = bound + 1e-9 * abs(bound) if isinstance(bound, float) else bound
    floor = lower - 1e-9 * abs(lower) if isinstance(lower, float) else lower
    total = prefix[n]
    width = len(penalties[1])
    infinity = None
    previous: list[tuple[Number, ...] | None] = [infinity] * (n + 1)
    previous[0] = (0,) * (width + 1)
    back: list[list[int]] = []
    for k in range(1, num_segments + 1):
        current: list[tuple[Number, ...] | None] = [infinity] * (n + 1)
        came_from = [-1] * (n + 1)
        ends = range(k, n - (num_segments - k) + 1) if k < num_segments else range(n, n + 1)
        window: deque[int] = deque()  # candidate starts i, scores increasing front to back
        next_start, low = 0, 0
        for j in ends:
            while next_start < j and prefix[j] - prefix[next_start] >= floor:  # admit starts
                score = previous[next_start]
                if score is not None:
                    while window and previous[window[-1]] >= score:  # type: ignore[operator]
                        window.pop()  # later start with an equal or better score wins
                    window.append(next_start)
                next_start += 1
            while prefix[j] - prefix[low] > limit:
                low += 1
            while window and window[0] < low:
                window.popleft()
            if not window:
                continue
            start = window[0]
            best = previous[start]
            assert best is not None
            if k < num_segments:
                ideal = k * total / num_segments
                cut = penalties[j] + (abs(prefix[j] - ideal),)
                current[j] = tuple(a + b for a, b in zip(best, cut, strict=True))
            else:
                current[j] = best
            came_from[j] = start
        back.append(came_from)
        previous = current
    if previous[n] is None:
        raise ValueError(f"no split into {num_segments} segments stays within {bound}")
    cuts, position = [], n
    for k in range(num_segments - 1, 0, -1):
        position = back[k][position]
        cuts.append(position)
    cuts.reverse()
    return cuts
