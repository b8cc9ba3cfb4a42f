"""Compact text for long lists of ranks and stages, so the planner's output reads at any W. Nothing
is approximated: each form expands back to exactly the list it stands for; where a list is still
too long, the text says how many items it leaves out.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Iterator, Sequence


def _runs(values: Sequence[int | None], descending: bool) -> Iterator[tuple[object, object, int]]:
    """``(first, last, step)`` of each maximal arithmetic run of three or more ints with a
    positive step (or, ``descending``, any non-zero step); any other item alone, with step 0."""
    i = 0
    while i < len(values):
        first, j, step = values[i], i, 0
        second = values[i + 1] if i + 2 < len(values) else None
        if first is not None and second is not None:
            step = second - first
            while j + 1 < len(values):
                current, following = values[j], values[j + 1]
                if following is None or current is None or following - current != step:
                    break
                j += 1
            if j - i < 2 or step == 0 or (step < 0 and not descending):
                j, step = i, 0
        yield first, values[j], step
        i = j + 1


def ranks_text(ranks: Sequence[int]) -> str:
    """``[0-3]``, ``[0-1022/2]``, ``[1,5,9-12]``: ascending ranks, runs of three or more as
    ``a-b`` (step 1) or ``a-b/k``."""
    parts = [str(a) if not step else f"{a}-{b}" + ("" if step == 1 else f"/{step}")
             for a, b, step in _runs(list(ranks), descending=False)]
    return "[" + ",".join(parts) + "]"


def sequence_text(values: Sequence[int | None]) -> str:
    """``20..1``, ``4,4,4..16/4``: per-worker numbers (activation caps), runs of three or more
    as ``a..b`` (step +-1) or ``a..b/k``. For reading only: ``--cap`` takes the comma list."""
    return ",".join(str(a) if not step else f"{a}..{b}" + ("" if abs(step) == 1 else f"/{abs(step)}")
                    for a, b, step in _runs(values, descending=True))


def owners_text(owners: Sequence[Sequence[int]], width: int = 160) -> str:
    """Every stage's owners in at most ``width`` characters, consecutive stages whose owners
    move by one fixed shift as one item: ``s0-1023: [0]+1`` (stage s owned by rank s),
    ``s0-3: [0-6/2]`` (all owned by 0, 2, 4, 6)."""
    items: list[str] = []
    s = 0
    while s < len(owners):
        first, end, shift = list(owners[s]), s, 0
        if s + 1 < len(owners) and len(owners[s + 1]) == len(first):
            shift = owners[s + 1][0] - first[0] if first else 0
            while (end + 1 < len(owners)
                   and list(owners[end + 1]) == [r + shift * (end + 1 - s) for r in first]):
                end += 1
        label = f"s{s}" if end == s else f"s{s}-{end}"
        items.append(f"{label}: {ranks_text(first)}" + (f"{shift:+d}" if end > s and shift else ""))
        s = end + 1
    text = "; ".join(items)
    if len(text) <= width:
        return text
    # the items that leave room for the count of what is left out (28 characters)
    shown = sum(used + 28 <= width for used in accumulate(len(item) + 2 for item in items))
    return "; ".join(items[:shown]) + f"; ... ({len(items) - shown} more stage groups)"


def fold_rows(rows: Sequence[Sequence[object]]) -> list[list[object]]:
    """Rows equal but for their first cell (the worker) as one row, first cell its workers as in
    :func:`ranks_text` (cut to 40 characters with their count when irregular), in worker order."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for row in rows:
        groups.setdefault(tuple(row[1:]), []).append(int(str(row[0])))
    folded: list[list[object]] = []
    for cells, workers in groups.items():
        label = ranks_text(workers)[1:-1]
        if len(label) > 40:
            label = label[:24].rsplit(",", 1)[0] + f",... ({len(workers)} workers)"
        folded.append([label, *cells])
    return folded
