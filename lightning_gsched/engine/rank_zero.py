"""Rank 0 decides, one broadcast tells every rank: its result, or the error every rank raises.

Why one helper: the build makes three decisions this way (the cut's unit costs under
``balance="time"``, ``"auto"``'s pick, ``profile_costs``' timings), each because every rank must
plan from the same numbers and only one rank should pay for measuring them. They must end alike
on every rank: whatever rank 0 fails with (one of our errors or any other exception) reaches
every rank as one error naming the cause, never a rank left waiting for a broadcast that does
not come; on rank 0 the original exception is the cause of the one raised. The broadcast runs
through the engine's ``collective(what, fn)``, so a lost peer there is a fault quoting the job's
first failure (:mod:`.control`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from lightning_gsched.engine.control import Collective
from lightning_gsched.errors import GschedError

_T = TypeVar("_T")


@dataclass(frozen=True)
class RankZeroFailure:
    """What rank 0 failed with, as every rank receives it: ``kind`` is the error's class when it
    is one of ours (every rank raises the same kind), None for any other exception; ``text``
    its message (prefixed with the exception's type name when it is not one of ours)."""

    kind: type[GschedError] | None
    text: str


def decided_by_rank_zero(what: str, decide: Callable[[], _T], *, rank: int, world_size: int,
                         group: Any, collective: Collective,
                         failure: Callable[[RankZeroFailure], GschedError],
                         elsewhere: Callable[[], None] | None = None) -> _T:
    """``decide()`` on rank 0, its result on every rank (collective: one object broadcast).

    ``failure(f)``: the error every rank raises when rank 0's ``decide`` raised (``f`` says
    what it raised). ``elsewhere()``: what the other ranks run meanwhile (e.g. their part of
    rank 0's measurements); what it raises is dropped, as rank 0's outcome is everyone's."""
    cause: BaseException | None = None
    outcome: tuple[str, Any] = ("pending", None)
    if rank == 0:
        try:
            outcome = ("ok", decide())
        except Exception as exc:  # noqa: BLE001 - any failure must reach every rank
            cause = exc
            outcome = ("error", _failure_of(exc))
    elif elsewhere is not None:
        try:
            elsewhere()
        except Exception:  # noqa: BLE001, S110 - rank 0's outcome (below) is everyone's
            pass
    if world_size > 1:
        box: list[Any] = [outcome]
        collective(what, lambda: dist.broadcast_object_list(box, 0, group=group))
        outcome = box[0]
    status, value = outcome
    if status == "error":
        raise failure(value) from cause
    result: _T = value
    return result


def _failure_of(exc: Exception) -> RankZeroFailure:
    """``exc`` as every rank receives it (an exception object itself may not pickle)."""
    if isinstance(exc, GschedError):
        return RankZeroFailure(type(exc), str(exc))
    return RankZeroFailure(None, f"{type(exc).__name__}: {exc}")
