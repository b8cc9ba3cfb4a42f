"""``decided_by_rank_zero``: what rank 0 decides, or fails with, reaches every rank alike.

The build's three rank-0 decisions (the cut's unit costs under ``balance="time"``, ``"auto"``'s
pick, ``profile_costs``' timings) go through this one helper. Checked on a W=2 gloo job: the
value computed on rank 0 only is every rank's; rank 0's error of ours is raised as that kind
on every rank, any other exception as the caller's error with the type named, the original the
cause on rank 0; what the other ranks run meanwhile may fail without changing the outcome; the
broadcast runs through the caller's ``collective`` under the given name.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from dist_harness import WorkerContext
from lightning_gsched.engine.rank_zero import RankZeroFailure, decided_by_rank_zero
from lightning_gsched.errors import GschedError, PartitionError, StrategyConfigError

pytestmark = pytest.mark.distributed


def _caught(call: Callable[[], Any]) -> tuple[str, str, str | None]:
    try:
        call()
    except GschedError as exc:
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return type(exc).__name__, str(exc), cause
    raise AssertionError("no error raised")


def decisions_on_worker(ctx: WorkerContext) -> dict[str, Any]:
    names: list[str] = []

    def collective(what: str, call: Callable[[], Any]) -> Any:
        names.append(what)
        return call()

    def failure(failed: RankZeroFailure) -> GschedError:
        kind = failed.kind or StrategyConfigError
        return kind(f"decided: {failed.text}")

    def decide(fn: Callable[[], Any], elsewhere: Callable[[], None] | None = None) -> Any:
        return decided_by_rank_zero("the check's broadcast", fn, rank=ctx.rank,
                                    world_size=ctx.world_size, group=None,
                                    collective=collective, failure=failure,
                                    elsewhere=elsewhere)

    def ours() -> Any:
        raise PartitionError("no cut fits")

    def other() -> Any:
        raise ValueError("boom")

    def fails_elsewhere() -> None:
        raise RuntimeError("a helper rank's own failure")

    ran_elsewhere: list[int] = []
    return {
        "value": decide(lambda: {"rank": ctx.rank, "costs": [1.5, 2.5]},
                        lambda: ran_elsewhere.append(ctx.rank)),
        "ours": _caught(lambda: decide(ours)),
        "other": _caught(lambda: decide(other)),
        "despite_elsewhere": decide(lambda: 7, fails_elsewhere),
        "ran_elsewhere": ran_elsewhere,
        "names": names,
    }


def test_rank_zero_decides_for_every_rank(world: Any) -> None:
    results = world.run(decisions_on_worker)
    for rank, got in enumerate(results):
        assert got["value"] == {"rank": 0, "costs": [1.5, 2.5]}, rank  # rank 0's, everywhere
        assert got["despite_elsewhere"] == 7, rank
        assert got["ran_elsewhere"] == ([] if rank == 0 else [rank])
        cause = "PartitionError" if rank == 0 else None  # the original stays on rank 0
        assert got["ours"] == ("PartitionError", "decided: no cut fits", cause), rank
        cause = "ValueError" if rank == 0 else None
        assert got["other"] == ("StrategyConfigError", "decided: ValueError: boom", cause), rank
        assert got["names"] == ["the check's broadcast"] * 4, rank
