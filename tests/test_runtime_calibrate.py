"""calibrate(): RuntimeCosts measured on the job's own process group (W=2 gloo world)."""

from __future__ import annotations

import math

import pytest

from dist_harness import WorkerContext
from lightning_gsched.errors import CalibrationError, RuntimeConfigError

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
    for name in ("bandwidth", "allreduce_bandwidth"):
        value = getattr(c, name)  # fitted or refused (CalibrationError), never infinite
        assert 0 < value and math.isfinite(value), name
    # the model then charges a 1 MB message more than an empty one
    assert math.isfinite(c.message_time(1e6)) and c.message_time(1e6) > c.latency


def test_calibration_needs_a_process_group() -> None:
    import torch.distributed as dist

    from lightning_gsched.runtime.calibration import calibrate

    if dist.is_initialized():
        pytest.skip("this process has a process group")
    with pytest.raises(RuntimeConfigError, match="init_process_group"):
        calibrate()


def test_allreduce_fit_keeps_the_small_all_reduce_cost_and_fits_the_slope_above_it() -> None:
    from lightning_gsched.runtime.calibration import ALLREDUCE_BYTES, fit_allreduce

    latency, per_ring_byte, world = 150e-6, 0.5e-9, 2
    ring = 2 * (world - 1) / world
    exact = [latency + ring * (n - ALLREDUCE_BYTES[0]) * per_ring_byte for n in ALLREDUCE_BYTES]
    got = fit_allreduce(exact, world)
    assert got[0] == pytest.approx(latency) and got[1] == pytest.approx(per_ring_byte)
    # large sizes measured slow relative to the middle one: one least-squares line through all
    # sizes would put its intercept below zero; the small all-reduce must still cost its time
    skewed = [latency, 0.3e-3, 4.0e-3][: len(ALLREDUCE_BYTES)]
    small, slope = fit_allreduce(skewed, world)
    assert small == latency and slope > 0


def _figures(ping, send, recv, allreduce):
    """The raw list fit_message_costs reads: ping one-way per size, send/recv CPU fits, all-reduces."""
    return [*ping, *send, *recv, *allreduce]


def test_message_fit_charges_one_isolated_message_its_measured_one_way_time() -> None:
    from lightning_gsched.runtime.calibration import (
        ALLREDUCE_BYTES,
        PING_BYTES,
        fit_message_costs,
    )

    # one-way = 100 us + 0.3 ns/B; both ends' per-byte CPU (0.2 ns each) sum above the wall
    # slope, as measured on the 2-core machine: the ends copy while the bytes flow
    ping = [100e-6 + 0.3e-9 * n for n in PING_BYTES]
    allreduce = [200e-6 + 1e-9 * (n - ALLREDUCE_BYTES[0]) for n in ALLREDUCE_BYTES]
    c = fit_message_costs(_figures(ping, (20e-6, 0.2e-9), (30e-6, 0.2e-9), allreduce), 2)
    assert math.isfinite(c.bandwidth) and c.bandwidth == pytest.approx(1 / 0.1e-9)
    assert c.latency == pytest.approx(50e-6)
    # the replay charges the sender's fixed CPU, the flight, then the receiver's CPU: in all,
    # the measured one-way time of every size
    for n in PING_BYTES:
        one_way = c.send_cpu + c.message_time(n) + c.recv_time(n)
        assert one_way == pytest.approx(100e-6 + 0.3e-9 * n)
    assert c.allreduce_bandwidth == pytest.approx(1e9)
    # a burst of load on the 4-byte ping-pong leaves the fixed part to the 256 KiB one
    burst = [ping[0] + 1.4e-3, *ping[1:]]
    c2 = fit_message_costs(_figures(burst, (20e-6, 0.2e-9), (30e-6, 0.2e-9), allreduce), 2)
    assert c2.latency == pytest.approx(50e-6, abs=15e-6)  # the slope bends a little


def test_message_fit_refuses_a_slope_lost_in_noise_rather_than_report_infinity() -> None:
    from lightning_gsched.runtime.calibration import (
        ALLREDUCE_BYTES,
        PING_BYTES,
        fit_message_costs,
    )

    good_allreduce = [200e-6 + 1e-9 * n for n in ALLREDUCE_BYTES]
    flat = [500e-6] * len(PING_BYTES)  # a busy machine: sizes indistinguishable
    with pytest.raises(CalibrationError, match="point-to-point bandwidth cannot be fitted"):
        fit_message_costs(_figures(flat, (20e-6, 0.2e-9), (30e-6, 0.2e-9), good_allreduce), 2)
    ping = [100e-6 + 0.3e-9 * n for n in PING_BYTES]
    shrinking = [300e-6, 250e-6, 200e-6][: len(ALLREDUCE_BYTES)]
    with pytest.raises(CalibrationError, match="all-reduce bandwidth cannot be fitted"):
        fit_message_costs(_figures(ping, (20e-6, 0.2e-9), (30e-6, 0.2e-9), shrinking), 2)
