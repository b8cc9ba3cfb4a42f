"""calibrate(): RuntimeCosts measured on the job's own process group (W=2 gloo world)."""

from __future__ import annotations

import math

import pytest

from dist_harness import WorkerContext
from lightning_gsched.errors import RuntimeConfigError

WORLD = 2


def calibrate_on_rank(ctx: WorkerContext) -> dict:
    import time

    from lightning_gsched.runtime.calibration import calibrate

    start = time.perf_counter()
    costs = calibrate(repeats=3)
    return {"costs": costs, "seconds": time.perf_counter() - start}


def test_calibration_gives_every_rank_the_same_positive_finite_costs(worlds) -> None:
    results = worlds.get(WORLD).run(calibrate_on_rank)
    costs = [r["costs"] for r in results]
    assert costs[0] == costs[1]  # averaged over ranks: ranks that plan with them plan alike
    c = costs[0]
    for name in ("send_cpu", "recv_cpu", "allreduce_latency"):
        value = getattr(c, name)
        assert 0 < value < 1, name  # a message or a small all-reduce costs something, < 1 s
    for name in ("latency", "job_cpu", "step_cpu"):
        # fitted differences: >= 0 by construction, may be 0 where noise exceeds the effect
        assert 0 <= getattr(c, name) < 1, name
    assert 0 < c.bandwidth and 0 < c.allreduce_bandwidth  # inf allowed: slope within noise
    # the model then charges a 1 MB message something finite and non-negative
    assert math.isfinite(c.message_time(1e6)) and c.message_time(1e6) >= c.latency


def test_calibration_needs_a_process_group() -> None:
    import torch.distributed as dist

    from lightning_gsched.runtime.calibration import calibrate

    if dist.is_initialized():
        pytest.skip("this process has a process group")
    with pytest.raises(RuntimeConfigError, match="init_process_group"):
        calibrate()


def test_allreduce_fit_keeps_the_small_all_reduce_cost_and_fits_the_slope_above_it() -> None:
    from lightning_gsched.runtime.calibration import ALLREDUCE_BYTES, _fit_allreduce

    latency, per_ring_byte, world = 150e-6, 0.5e-9, 2
    ring = 2 * (world - 1) / world
    exact = [latency + ring * (n - ALLREDUCE_BYTES[0]) * per_ring_byte for n in ALLREDUCE_BYTES]
    got = _fit_allreduce(exact, world)
    assert got[0] == pytest.approx(latency) and got[1] == pytest.approx(per_ring_byte)
    # large sizes measured slow relative to the middle one: one least-squares line through all
    # sizes would put its intercept below zero; the small all-reduce must still cost its time
    skewed = [latency, 0.3e-3, 4.0e-3][: len(ALLREDUCE_BYTES)]
    small, slope = _fit_allreduce(skewed, world)
    assert small == latency and slope > 0
