"""Priorities as dense ranks: ``n(s, b, d)`` evaluated once per plan, turned into the ints the
simulator's queues compare.

A library order (:data:`~lightning_gsched.schedule.orders.LAYOUTS`) is enumerated from its
written-out layout without calling it; any other order's values are sorted with the job as the
tie-break, packed into one int per job where they are ints or tuples of ints.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.jobs import Phase, all_jobs, phases_of
from lightning_gsched.schedule.orders import OrderLayout, PriorityFn, layout_of


def priority_ranks(
    priority: PriorityFn, stages: int, micro: int, forward_only: bool = False,
    split_backward: bool = False,
) -> list[int]:
    """Evaluate n(s, b, d) once and turn it into dense integer ranks (fast heap keys).

    The result is indexed by the flat job index ``(stage * micro + b) * P + phase`` (P phases
    per job in the order F, B, W: :func:`phases_of`), the layout :func:`simulate` works in.
    Rank order is that of the pairs (n(job), job): equal priorities are broken by the job
    itself. A library order's ranking is enumerated from its written-out layout
    (:data:`~lightning_gsched.schedule.orders.LAYOUTS`) without calling it; other orders
    returning ints or tuples of ints are packed into one int per job that orders as the pair
    does (:func:`_packed`), so the sort compares ints, not tuples.
    """
    phases = phases_of(forward_only, split_backward)
    layout = layout_of(priority)
    if layout is not None:
        return inverse(_layout_order(layout, stages, micro, phases))
    keys: list[Any] = []
    append = keys.append
    s = b = 0
    d = phases[0]
    try:  # one try around the loop: no per-job cost on the planner's hot path
        for s in range(stages):
            for b in range(micro):
                for d in phases:
                    append(priority(s, b, d))
    except Exception as exc:  # noqa: BLE001 - any failure inside the user's n(s, b, d)
        raise validate.user_callable_error(
            "priority", priority, (s, b, d), "s, b, d", exc) from exc
    packed = _packed(keys, phases)
    try:
        if packed is not None:
            order = sorted(range(len(keys)), key=packed.__getitem__)
        else:
            jobs = list(all_jobs(stages, micro, forward_only, split_backward))
            order = sorted(range(len(keys)), key=lambda i: (keys[i], jobs[i]))
    except TypeError as exc:
        raise ScheduleConfigError(
            f"priority values must be mutually comparable (ints or tuples of ints): {exc}"
        ) from exc
    return inverse(order)


def inverse(permutation: list[int]) -> list[int]:
    """``inverse[permutation[i]] = i`` (ranks from a ranked order, or back), in one C loop."""
    inverse = [0] * len(permutation)
    deque(map(inverse.__setitem__, permutation, range(len(permutation))), maxlen=0)
    return inverse


def _layout_order(layout: OrderLayout, stages: int, micro: int,
                  phases: tuple[Phase, ...]) -> list[int]:
    """Flat job indices in the order a library order's layout ranks them (see orders.py)."""
    P = len(phases)
    index_of = {d: k for k, d in enumerate(phases)}
    order: list[int] = []
    for group, major, minor in layout:
        ks = [index_of[d] for d in sorted(group, key=str) if d in index_of]
        if not ks:
            continue
        loops = []
        for name, ascending in (major, minor):
            span = range(stages if name == "stage" else micro)
            loops.append(span if ascending else span[::-1])
        outer, inner = loops
        if major[0] == "stage":  # flat = (stage * micro + b) * P + k
            order += [(x * micro + y) * P + k for x in outer for y in inner for k in ks]
        else:
            order += [(y * micro + x) * P + k for x in outer for y in inner for k in ks]
    return order


def _packed(keys: list[Any], phases: tuple[Phase, ...]) -> list[int] | None:
    """One int per job ordering as (key, job) does, when every key is an int or every key a
    tuple of ints of one length; None otherwise (then the pairs themselves are sorted).

    Each key component is shifted to start at 0 and the tuple read as a mixed-radix number
    (radix: that component's range), which orders exactly as the tuples do; the lowest digit is
    the job's place in job order ((stage, micro), then the phase by its text: B < F < W), the
    tie-break. ``keys`` are listed stage, micro, then ``phases`` (the flat job order).
    """
    if not keys:
        return None
    columns: list[Sequence[Any]] = [keys]
    if type(keys[0]) is tuple:
        if set(map(type, keys)) != {tuple} or len(set(map(len, keys))) != 1:
            return None
        columns = list(zip(*keys, strict=True))
    packed = [0] * len(keys)
    for column in columns:
        if set(map(type, column)) != {int}:  # exactly int: no bool, float or subclass
            return None
        low = min(column)
        radix = max(column) - low + 1
        packed = [p * radix + (x - low) for p, x in zip(packed, column, strict=True)]
    text_rank = {d: r for r, d in enumerate(sorted(phases, key=str))}
    P = len(phases)
    groups = len(keys) // P  # (stage, micro) pairs, in job order already
    tie = [text_rank[d] for d in phases] * groups
    return [(p * groups + i // P) * P + t
            for i, (p, t) in enumerate(zip(packed, tie, strict=True))]
