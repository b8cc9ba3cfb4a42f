"""Priorities as dense ranks: ``n(s, b, d)`` evaluated once per plan, turned into the ints the
simulator's queues compare, in the order of the pairs (n(job), job)."""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.jobs import Phase, all_jobs, phases_of
from lightning_gsched.schedule.orders import InterleavedOrder, PriorityFn, layout_of


def priority_ranks(priority: PriorityFn, stages: int, micro: int, forward_only: bool = False,
                   split_backward: bool = False) -> list[int]:
    """Dense integer ranks (heap keys) by flat job index. An order with a formula
    (:func:`order_keys`) is not called per job; other orders' ints or tuples of ints are packed
    into one int per job (:func:`_packed`) for a sort of ints."""
    phases = phases_of(forward_only, split_backward)
    known = order_keys(priority, stages, micro, phases)
    if known is not None:
        return dense_ranks(known).tolist()  # type: ignore[no-any-return]
    keys: list[Any] = []
    append = keys.append
    s, b, d = 0, 0, phases[0]
    try:  # one try around the loop: no per-job cost on the planner's hot path
        for s in range(stages):
            for b in range(micro):
                for d in phases:
                    append(priority(s, b, d))
    except Exception as exc:  # noqa: BLE001 - any failure inside the user's n(s, b, d)
        raise validate.user_callable_error("priority", priority, (s, b, d), "s, b, d", exc) from exc
    packed = _packed(keys, phases)
    try:
        if packed is not None:
            order = sorted(range(len(keys)), key=packed.__getitem__)
        else:
            jobs = list(all_jobs(stages, micro, forward_only, split_backward))
            order = sorted(range(len(keys)), key=lambda i: (keys[i], jobs[i]))
    except TypeError as exc:
        raise ScheduleConfigError(
            f"priority values must be mutually comparable (ints or tuples of ints): {exc}") from exc
    return inverse(order)


def dense_ranks(keys: np.ndarray) -> np.ndarray:
    """0 .. J-1 in the order of ``keys`` (unique ints): the smallest ints that order alike."""
    ranks = np.empty(len(keys), dtype=np.int64)
    ranks[np.argsort(keys, kind="stable")] = np.arange(len(keys))
    return ranks


def inverse(permutation: list[int]) -> list[int]:
    """``inverse[permutation[i]] = i`` (ranks from a ranked order, or back), in one C loop."""
    inverse = [0] * len(permutation)
    deque(map(inverse.__setitem__, permutation, range(len(permutation))), maxlen=0)
    return inverse


def order_keys(priority: PriorityFn, stages: int, micro: int,
               phases: tuple[Phase, ...]) -> np.ndarray | None:
    """Keys (int64 per flat job index) that order jobs as the pairs (n(job), job) do, for the
    orders with a formula: a library order's layout and interleaved's positions; else None. The
    job tie-break is (stage, micro, phase by its text: B < F < W), as ``Job`` compares."""
    layout = layout_of(priority)
    if layout is None and not isinstance(priority, InterleavedOrder):
        return None
    P = len(phases)
    keys = np.empty((stages, micro, P), dtype=np.int64)
    stage = np.arange(stages, dtype=np.int64)[:, None]
    b = np.arange(micro, dtype=np.int64)[None, :]
    job = (stage * micro + b) * 3  # the job's place in (stage, micro, phase text) order
    span = max(stages, micro)

    def index(loop: tuple[str, bool]) -> np.ndarray:  # a loop's place, reversed if it descends
        value, size = (stage, stages) if loop[0] == "stage" else (b, micro)
        return value if loop[1] else size - 1 - value

    for k, d in enumerate(phases):
        if isinstance(priority, InterleavedOrder):
            at = priority.positions(stage, b, np.full((1, 1), d is not Phase.F))
            keys[:, :, k] = at * (stages * micro * 3) + job + _TEXT_RANK[d]
            continue
        assert layout is not None
        group, major, minor = next((g, major, minor) for g, (members, major, minor)
                                   in enumerate(layout) if d in members)
        # ((group * span + major) * span + minor) * 3 + text rank, written into the keys
        # in place: a (stages x micro) temporary per operation is 32 MB of fresh pages each
        # at W=1024 (S = B = 2048), which cost more than the arithmetic
        column = keys[:, :, k]
        np.add((group * span + index(major)) * span, index(minor), out=column)
        column *= 3
        column += _TEXT_RANK[d]
    return keys.reshape(-1)


_TEXT_RANK = {Phase.B: 0, Phase.F: 1, Phase.W: 2}


def _packed(keys: list[Any], phases: tuple[Phase, ...]) -> list[int] | None:
    """One int per job ordering as (key, job) does, when every key is an int or every key a tuple
    of ints of one length (else None: the pairs are sorted): each component shifted to start at
    0, the tuple read as a mixed-radix number (radix: the component's range), which orders as
    the tuples do; the lowest digit is the job's place in flat job order (the tie-break)."""
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
    return [(p * groups + i // P) * P + t for i, (p, t) in enumerate(zip(packed, tie, strict=True))]
