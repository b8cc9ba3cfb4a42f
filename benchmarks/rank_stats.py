"""Rank statistics for the tune row: does the tuner order candidates as they really run?

Why a module of its own (and not scipy): the benchmarks need one small, tested function, and
the project does not depend on scipy.
"""

from __future__ import annotations

from typing import Sequence


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``; tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: the Pearson correlation of the two rank lists.

    1: the same order, -1: reversed. Raises ValueError for fewer than two pairs or a constant
    side (no order to compare).
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"spearman needs two equally long lists of >= 2 values, got "
                         f"{len(xs)} and {len(ys)}")
    rx, ry = ranks(xs), ranks(ys)
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        raise ValueError("spearman: one side is constant, so it has no order")
    return float(sxy / (sxx * syy) ** 0.5)
