"""Compact text for long lists of ranks and stages, so the planner's output reads at any W.

At W=1024 a stage's owners were printed as a list of up to 1,024 ints and the owner list of all
stages as one line of tens of thousands of characters. These helpers write the same facts in a
bounded width: a set of ranks as arithmetic runs (``0-1022/2`` = 0, 2, ..., 1022), runs of
stages whose owners move by a fixed step as one item (``s0-1023: [0]+1`` = stage s owned by
rank s), and identical table rows over consecutive workers as one row (``0-1023``). Nothing is
approximated: each form expands back to exactly the list it stands for; where a list is still
too long, the text says how many items it leaves out.
"""

from __future__ import annotations

from typing import Sequence


def ranks_text(ranks: Sequence[int]) -> str:
    """``[0-3]``, ``[0-1022/2]``, ``[1,5,9-12]``: ascending ranks as maximal arithmetic runs
    (a run of three or more with step 1 is ``a-b``, with step k ``a-b/k``)."""
    parts: list[str] = []
    values = list(ranks)
    i = 0
    while i < len(values):
        j = i
        if i + 2 < len(values):
            step = values[i + 1] - values[i]
            while j + 1 < len(values) and values[j + 1] - values[j] == step:
                j += 1
            if j - i < 2 or step <= 0:
                j = i
        if j == i:
            parts.append(str(values[i]))
            i += 1
            continue
        step = values[i + 1] - values[i]
        parts.append(f"{values[i]}-{values[j]}" + ("" if step == 1 else f"/{step}"))
        i = j + 1
    return "[" + ",".join(parts) + "]"


def sequence_text(values: Sequence[int | None]) -> str:
    """``20..1``, ``4,4,4..16/4``: a list of per-worker numbers (activation caps) as maximal
    arithmetic runs of three or more, ``a..b`` (step +-1) or ``a..b/k``; other items as they
    are. For reading only: the CLI's ``--cap`` takes the plain comma list."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        a = values[i]
        j = i
        if a is not None and i + 2 < len(values):
            b = values[i + 1]
            step = b - a if b is not None else 0
            while step and j + 1 < len(values):
                nxt = values[j + 1]
                cur = values[j]
                if nxt is None or cur is None or nxt - cur != step:
                    break
                j += 1
            if j - i < 2:
                j = i
        if j == i:
            parts.append(str(a))
            i += 1
            continue
        step = values[i + 1] - a  # type: ignore[operator]  # both ints: checked above
        parts.append(f"{a}..{values[j]}" + ("" if abs(step) == 1 else f"/{abs(step)}"))
        i = j + 1
    return ",".join(parts)


def owners_text(owners: Sequence[Sequence[int]], width: int = 160) -> str:
    """The owners of every stage in at most ``width`` characters (a count of what is left out
    beyond that): consecutive stages whose owner sets differ by one fixed shift are one item,
    ``s0-1023: [0]+1`` (stage s owned by rank s), ``s0-3: [0-6/2]`` (all owned by 0, 2, 4, 6)."""
    items: list[str] = []
    s = 0
    while s < len(owners):
        first = list(owners[s])
        end = s
        shift = 0
        if s + 1 < len(owners) and len(owners[s + 1]) == len(first):
            shift = owners[s + 1][0] - first[0] if first else 0
            while (end + 1 < len(owners)
                   and list(owners[end + 1]) == [r + shift * (end + 1 - s) for r in first]):
                end += 1
        label = f"s{s}" if end == s else f"s{s}-{end}"
        text = ranks_text(first)
        if end > s and shift:
            text += f"{shift:+d}"
        items.append(f"{label}: {text}")
        s = end + 1
    return bounded(items, width, "stage groups")


def bounded(items: Sequence[str], width: int, noun: str) -> str:
    """``items`` joined by ``"; "``, cut before ``width`` characters with ``... (N more noun)``."""
    text = "; ".join(items)
    if len(text) <= width:
        return text
    shown: list[str] = []
    used = 0
    for item in items:
        if used + len(item) + 2 + 28 > width:
            break
        shown.append(item)
        used += len(item) + 2
    return "; ".join(shown) + f"; ... ({len(items) - len(shown)} more {noun})"


def fold_rows(rows: Sequence[Sequence[object]], label_width: int = 40) -> list[list[object]]:
    """Rows equal but for their first cell (the worker) as one row, its first cell the workers
    it stands for in :func:`ranks_text`'s form (``0-1022/2``; cut to ``label_width`` with their
    count when irregular), in the order of each row's first worker: the per-worker table of a
    plan whose workers fall in a few classes (a pipeline's even and odd positions, say)."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for row in rows:
        groups.setdefault(tuple(row[1:]), []).append(int(str(row[0])))
    folded: list[list[object]] = []
    for cells, workers in groups.items():
        label = ranks_text(workers)[1:-1]
        if len(label) > label_width:
            label = label[: label_width - 16].rsplit(",", 1)[0] + f",... ({len(workers)} workers)"
        folded.append([label, *cells])
    return folded
