"""profile_stages: per-stage forward/backward seconds measured the way a pipeline runs them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_gsched.measure import profile_stages
from lightning_gsched.partition import PartitionError, partition
from models import gpt_inputs, make_gpt


def test_profiles_every_stage_in_pipeline_order_and_leaves_no_gradients():
    model = make_gpt()
    (idx,) = gpt_inputs(batch=4)
    part = partition(model, 3, (idx,))
    outputs = []

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        outputs.append(logits.detach())
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx.reshape(-1))

    times = profile_stages(part.stages, (idx,), loss_fn=loss_fn, repeats=3, warmup=1)
    assert len(times.forward) == len(times.backward) == 3
    assert all(t > 0 for t in times.forward + times.backward)
    assert times.total == pytest.approx(sum(times.forward) + sum(times.backward))
    # the last stage was fed the real chain: its output is the model's output on idx
    assert len(outputs) == 4
    with torch.no_grad():
        want = model(idx)
    torch.testing.assert_close(outputs[-1], want)
    # profiling must not leave gradients behind for the training that follows
    assert all(p.grad is None for p in model.parameters())


def test_no_stages_is_an_error():
    with pytest.raises(PartitionError, match="at least one stage"):
        profile_stages([], ())


def test_split_backward_times_b_and_w_as_the_runtime_runs_them():
    from lightning_gsched.schedule import plan

    model = make_gpt()
    (idx,) = gpt_inputs(batch=4)
    part = partition(model, 3, (idx,))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx.reshape(-1))

    times = profile_stages(part.stages, (idx,), loss_fn=loss_fn, repeats=2, warmup=1,
                           split_backward=True)
    assert len(times.forward) == len(times.backward) == len(times.weight) == 3
    # every stage has weights, so every W does work; stages 1 and 2 have input gradients
    assert all(t > 0 for t in times.weight + times.backward[1:])
    assert times.total == pytest.approx(sum(times.forward) + sum(times.backward)
                                        + sum(times.weight))
    assert all(p.grad is None for p in model.parameters())
    costs = times.plan_costs()
    assert costs["weight_cost"] == times.weight
    zb = plan("zb-h1", workers=3, microbatches=6, **costs)
    assert zb.costs.weight == tuple(times.weight)
    # without the split there is no W duration to hand to plan()
    whole = profile_stages(part.stages, (idx,), loss_fn=loss_fn, repeats=1, warmup=0)
    assert whole.weight == [] and "weight_cost" not in whole.plan_costs()


def test_fixed_shares_are_the_intercept_of_two_timings_clamped() -> None:
    from lightning_gsched.measure.tune_profile import MAX_FIXED_SHARE, fixed_shares

    # t(r) = 1 + r at r = 8 (9 s) and r = 4 (5 s): 1 s of 9 does not scale
    assert fixed_shares([9.0], [5.0], 0.5) == pytest.approx((1 / 9,))
    # half the rows slower than all of them (noise): capped; faster than linear: 0
    assert fixed_shares([1.0, 1.0], [1.2, 0.4], 0.5) == (MAX_FIXED_SHARE, 0.0)
