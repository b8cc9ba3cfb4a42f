"""Every library schedule plans every valid (W, S, B) by default, near the best order it could use.

Issue 12 part 2: a schedule's defaults (order, cap) must not fall apart away from its canonical
shape, e.g. with more stages than workers. For each library schedule and each (W, S, B) its
placement accepts in the grid below, the default plan must complete and its latency must be
within 5% of the best order the library offers for that placement, each order planned at the
schedule's default cap (the cap is the schedule's memory promise, so orders are compared under
it; where an order cannot complete under that cap it is left out).
"""

from __future__ import annotations

import pytest

from lightning_gsched.errors import CapTooSmallError, GschedError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.library import LIBRARY, get_schedule
from lightning_gsched.schedule.orders import ORDER_NAMES

ORDERS = [o for o in ORDER_NAMES if o != "dfs"]  # dfs is 1f1b's alias


def _shapes(name: str, W: int) -> list[tuple[int, int, int | None]]:
    spec = get_schedule(name)
    R = spec.default_R(W) if spec.default_R is not None else None
    base = spec.stages(W, R or 1)
    stage_counts = {base, 2 * base} | ({4 * base} if W <= 4 else set())
    return [(S, B, R) for S in sorted(stage_counts) for B in sorted({W, 2 * W, 4 * W})]


CASES = [pytest.param(name, W, S, B, R, id=f"{name}-W{W}-S{S}-B{B}")
         for name in LIBRARY for W in (1, 2, 3, 4, 8) for S, B, R in _shapes(name, W)]


@pytest.mark.parametrize("name,W,S,B,R", CASES)
def test_default_is_within_5_percent_of_the_best_order(name: str, W: int, S: int, B: int,
                                                       R: int | None) -> None:
    default = plan(name, W, S, B, R=R)  # _shapes gives only shapes the placement accepts
    spec = get_schedule(name)
    cap = spec.cap(W, S)
    best = default.metrics.latency
    for order in ORDERS:
        try:
            candidate = plan(name, W, S, B, R=R, order=order, cap=cap)
        except (CapTooSmallError, GschedError):
            continue  # this order cannot run under the cap, or does not fit the placement
        best = min(best, candidate.metrics.latency)
    assert default.metrics.latency <= 1.05 * best, (default.order, default.caps, best)


# ----------------------------------------------------------------------------- one vocabulary


CAP_CASES = [("1f1b", "default"), ("1f1b", None), ("1f1b", "none"), ("interleaved", "auto"),
             ("zb-h1", 3), ("gpipe", [2, 2, 1, 1])]


@pytest.mark.parametrize("schedule,cap", CAP_CASES, ids=[f"{s}-{c}" for s, c in CAP_CASES])
def test_plan_cli_and_strategy_resolve_alike(schedule: str, cap: object, capsys) -> None:
    """The same arguments given to plan(), to `gsched plan` and to GeneralParallel's schedule
    configuration resolve to the same S, B, R and caps (one resolution, one cap vocabulary)."""
    import json

    from lightning_gsched.cli import main
    from lightning_gsched.engine.options import pipeline_options

    W = 4
    direct = plan(schedule, W, cap=cap)  # type: ignore[arg-type]
    text = "none" if cap is None else ",".join(map(str, cap)) if isinstance(cap, list) else str(cap)
    assert main(["plan", schedule, "-w", str(W), "--cap", text, "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    config, _ = pipeline_options(schedule=schedule, cap=cap)
    strategy = config.training_plan(W)
    S, B, R = config.resolved(W)
    for got in ((cli["stages"], cli["microbatches"], cli["R"], cli["caps"]),
                (strategy.stages, strategy.micro, strategy.R, strategy.caps),
                (S, B, R, strategy.caps)):
        assert got == (direct.stages, direct.micro, direct.R, direct.caps)
    if cap in (None, "none"):
        assert direct.caps == [None] * W
