"""predict_step_time: replaying a plan's programs with communication costs."""

from __future__ import annotations

import pytest

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.memory import ModelSizes, StageSizes
from lightning_gsched.schedule.plan import plan
from lightning_gsched.schedule.predict import predict_step_time
from lightning_gsched.schedule.runtime_costs import RuntimeCosts


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
        slower = RuntimeCosts(latency=t, allreduce_latency=t)  # every message and reduction
        got = predict_step_time(p, costs=slower).latency
        assert got >= previous - 1e-9
        previous = got


def test_two_stage_pipeline_by_hand():
    # W=2, S=2, B=1: F0 [0,1] on w0, F1 [1+t, 2+t] on w1, B1 [2+t, 4+t], B0 [4+2t, 6+2t] on w0
    p = plan("gpipe", workers=2, microbatches=1)
    for t in (0.0, 0.3, 1.0):
        assert predict_step_time(p, costs=RuntimeCosts(latency=t)).latency == pytest.approx(
            6 + 2 * t)


def test_data_parallel_ends_with_its_all_reduce():
    # ddp W=2, B=2: each worker F+B of one microbatch (1+2), then the all-reduce of stage 0
    p = plan("ddp", workers=2, microbatches=2)
    got = predict_step_time(p, costs=RuntimeCosts(latency=5.0, allreduce_latency=0.75))
    assert got.latency == pytest.approx(3.75)
    assert got.compute_only == pytest.approx(3.0)
    assert got.latency - got.compute_only == pytest.approx(0.75)  # the all-reduce, added


def test_fsdp_waits_for_its_weight_fetches():
    p = plan("fsdp", workers=2, microbatches=2)
    # a 10-byte stage over a 1 B/s link: every fetch takes 10 s
    slow = predict_step_time(p, costs=RuntimeCosts(bandwidth=1.0),
                             sizes=_sizes(2, params=10)).latency
    assert slow >= p.metrics.latency + 10.0 - 1e-9


def test_bad_costs_are_refused():
    with pytest.raises(ScheduleConfigError, match="latency"):
        RuntimeCosts(latency=-1.0)
    p = plan("gpipe", workers=2, microbatches=2)
    with pytest.raises(TypeError):  # the fixed seconds of old: give RuntimeCosts and sizes
        predict_step_time(p, transfer=1.0)  # type: ignore[call-arg]


# ---------------------------------------------------------------- the runtime cost model

def _sizes(stages, message=0, params=0, grads=0):
    return ModelSizes(tuple(StageSizes(params=params, grads=grads, optimizer=0, activations=0,
                                       message=message) for _ in range(stages)))


def test_gpipe_charges_exactly_what_the_model_says():
    # W=2, S=2, B=2, F=1, B=2 (plan's default costs). Every rule applied by hand below, in the
    # order of the programs: rank 0 "F0 b0, SEND, RECV_GRAD, F0 b1, SEND, RECV_GRAD, B0 b0,
    # B0 b1"; rank 1 "RECV_ACT x2, F1 b0, F1 b1, B1 b0, SEND_GRAD, B1 b1, SEND_GRAD".
    costs = RuntimeCosts(latency=0.25, bandwidth=1000.0, send_cpu=0.1, recv_cpu=0.05,
                         send_cpu_per_byte=1e-4, recv_cpu_per_byte=2e-5, job_cpu=0.01,
                         step_cpu=0.5)
    p = plan("gpipe", workers=2, microbatches=2)
    flight = 0.25 + 1000 / 1000.0  # latency + bytes / bandwidth of one 1000-byte message
    cs = 0.1 + 1000 * 1e-4  # the sender's CPU for 1000 bytes
    cr = 0.05 + 1000 * 2e-5  # the receiver's
    j = 0.01
    # rank 0 forwards; each send costs its CPU and the message leaves after its fixed part (the
    # bytes flow while the sender writes them)
    f0_end = j + 1
    sent_a0 = f0_end + 0.1
    f1_end = f0_end + cs + j + 1
    sent_a1 = f1_end + 0.1
    # rank 1: both receives posted at 0; each forward waits for its message, then pays recv CPU
    r1 = max(0.0, sent_a0 + flight) + cr + j + 1
    r1 = max(r1, sent_a1 + flight) + cr + j + 1
    r1 += j + 2  # B s1 b0
    sent_g0 = r1 + 0.1
    r1 += cs
    r1 += j + 2  # B s1 b1
    sent_g1 = r1 + 0.1
    r1 += cs
    # rank 0 backwards wait for the input-gradients
    r0 = max(f1_end + cs, sent_g0 + flight) + cr + j + 2
    r0 = max(r0, sent_g1 + flight) + cr + j + 2
    expected = max(r0, r1, sent_g1 + flight) + 0.5
    got = predict_step_time(p, costs=costs, sizes=_sizes(2, message=1000))
    assert got.latency == pytest.approx(expected)
    assert got.worker_end[0] == pytest.approx(r0 + 0.5)
    assert got.compute_only == pytest.approx(p.metrics.latency)


def test_all_reduce_is_charged_by_bytes_and_group_size():
    # ddp W=2, B=2: each worker F+B of one microbatch, then its all-reduce of stage 0's grads
    costs = RuntimeCosts(allreduce_latency=0.2, allreduce_bandwidth=100.0, job_cpu=0.1)
    p = plan("ddp", workers=2, microbatches=2)
    got = predict_step_time(p, costs=costs, sizes=_sizes(1, grads=30))
    # ring among n=2: 2 (n - 1) / n = 1 pass of the 30 bytes
    assert got.latency == pytest.approx(3 + 2 * 0.1 + 0.2 + 30 / 100.0)
    assert RuntimeCosts(allreduce_bandwidth=1.0).allreduce_time(8, 4) == pytest.approx(12.0)
    assert RuntimeCosts(allreduce_latency=5.0).allreduce_time(8, 1) == 0.0


@pytest.mark.parametrize("schedule", sorted(LIBRARY))
def test_zero_runtime_costs_with_sizes_give_the_plans_latency(schedule):
    p = plan(schedule, workers=2, microbatches=4)
    sizes = _sizes(p.stages, message=10**6, params=10**7, grads=10**7)
    got = predict_step_time(p, costs=RuntimeCosts(), sizes=sizes)
    assert got.latency == pytest.approx(p.metrics.latency)


@pytest.mark.parametrize("field", ["latency", "send_cpu", "recv_cpu", "job_cpu", "step_cpu",
                                   "allreduce_latency", "send_cpu_per_byte",
                                   "recv_cpu_per_byte"])
@pytest.mark.parametrize("schedule", ["gpipe", "fsdp", "ddp", "zbv"])
def test_every_runtime_cost_adds_where_the_schedule_pays_it(schedule, field):
    p = plan(schedule, workers=2, microbatches=4)
    base = predict_step_time(p).latency
    got = predict_step_time(p, costs=RuntimeCosts(**{field: 0.3}),
                            sizes=_sizes(p.stages, message=1, params=1, grads=1)).latency
    pays = {"latency": schedule != "ddp", "send_cpu": schedule != "ddp",
            "recv_cpu": schedule != "ddp", "allreduce_latency": schedule == "ddp",
            "send_cpu_per_byte": schedule != "ddp", "recv_cpu_per_byte": schedule != "ddp"}  # fsdp hands gradients to owners
    if pays.get(field, True):
        assert got > base + 0.29
    else:
        assert got == pytest.approx(base)


def test_fsdp_fetch_bytes_cost_bandwidth():
    p = plan("fsdp", workers=2, microbatches=2)
    slow = predict_step_time(p, costs=RuntimeCosts(bandwidth=1.0), sizes=_sizes(2, params=5))
    fast = predict_step_time(p, costs=RuntimeCosts(bandwidth=1.0), sizes=_sizes(2, params=1))
    assert slow.latency >= fast.latency + 4 - 1e-9  # the first fetch alone waits 4 s longer


def test_bad_runtime_costs_are_refused():
    with pytest.raises(ScheduleConfigError, match="send_cpu"):
        RuntimeCosts(send_cpu=-1.0)
    with pytest.raises(ScheduleConfigError, match="bandwidth"):
        RuntimeCosts(bandwidth=0.0)
    p = plan("gpipe", workers=2, microbatches=2)
    with pytest.raises(ScheduleConfigError, match="3 stages"):
        predict_step_time(p, costs=RuntimeCosts(), sizes=_sizes(3))
