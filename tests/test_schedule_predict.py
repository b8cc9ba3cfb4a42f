"""predict_step_time: replaying a plan's programs with communication costs."""

from __future__ import annotations

import pytest

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.plan import plan
from lightning_gsched.schedule.predict import predict_step_time


@pytest.mark.parametrize("schedule", sorted(LIBRARY))
@pytest.mark.parametrize("W", [2, 4])
def test_without_communication_the_replay_is_the_plans_latency(schedule, W):
    p = plan(schedule, workers=W, microbatches=8)
    assert predict_step_time(p).latency == pytest.approx(p.metrics.latency)


@pytest.mark.parametrize("schedule", sorted(LIBRARY))
def test_uneven_costs_replay_equals_latency_and_communication_only_adds(schedule):
    base = plan(schedule, workers=4, microbatches=8)
    S = base.stages
    fwd = [1.0 + 0.25 * (s % 3) for s in range(S)]
    bwd = [2.0 + 0.5 * (s % 2) for s in range(S)]
    p = plan(schedule, workers=4, microbatches=8, forward_cost=fwd, backward_cost=bwd)
    assert predict_step_time(p).latency == pytest.approx(p.metrics.latency)
    previous = p.metrics.latency
    for t in (0.1, 0.5, 2.0):
        got = predict_step_time(p, transfer=t, fetch=t, reduce=t).latency
        assert got >= previous - 1e-9
        previous = got


def test_two_stage_pipeline_by_hand():
    # W=2, S=2, B=1: F0 [0,1] on w0, F1 [1+t, 2+t] on w1, B1 [2+t, 4+t], B0 [4+2t, 6+2t] on w0
    p = plan("gpipe", workers=2, microbatches=1)
    for t in (0.0, 0.3, 1.0):
        assert predict_step_time(p, transfer=t).latency == pytest.approx(6 + 2 * t)


def test_data_parallel_ends_with_its_all_reduce():
    # ddp W=2, B=2: each worker F+B of one microbatch (1+2), then the all-reduce of stage 0
    p = plan("ddp", workers=2, microbatches=2)
    got = predict_step_time(p, transfer=5.0, reduce=0.75)
    assert got.latency == pytest.approx(3.75)
    assert got.compute_only == pytest.approx(3.0)
    assert got.communication_share == pytest.approx(0.75 / 3.75)


def test_fsdp_waits_for_its_weight_fetches():
    p = plan("fsdp", workers=2, microbatches=2)
    slow = predict_step_time(p, fetch=10.0).latency
    assert slow >= p.metrics.latency + 10.0 - 1e-9


def test_bad_costs_are_refused():
    p = plan("gpipe", workers=2, microbatches=2)
    with pytest.raises(ScheduleConfigError, match="reduce"):
        predict_step_time(p, reduce=[1.0])
    with pytest.raises(ScheduleConfigError, match="transfer"):
        predict_step_time(p, transfer=-1.0)
