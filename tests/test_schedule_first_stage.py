"""The engine's default costs for a split backward (schedule/first_stage.py).

The re-timing is checked against an independent implementation: the predictor's replay of the
lowered programs (schedule/predict.py) with no runtime costs walks the per-rank programs, not
the timeline, and must end at the same time for the same durations. The choice is checked
against both orders' latencies at the true shape, computed here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lightning_gsched.engine.config import ScheduleConfig
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.arguments import ScheduleArguments
from lightning_gsched.schedule.first_stage import (
    first_stage_backward_in_w,
    first_stage_costs,
    retimed_latency,
)
from lightning_gsched.schedule.jobs import StageGraph
from lightning_gsched.schedule.predict import predict_step_time

SPLIT = [("zb-h1", 2, 2), ("zb-h1", 4, 4), ("zbv", 2, 4), ("zbv", 4, 8), ("zb-h2", 4, 4),
         ("v-half", 4, 8), ("v-min", 4, 8)]


@pytest.mark.parametrize(("name", "W", "S"), SPLIT)
def test_retimed_orders_end_where_the_programs_replay_ends(name: str, W: int, S: int) -> None:
    base = plan(name, W, stages=S, microbatches=8)
    graph = StageGraph(S, split_backward=True)
    # with its own costs a greedy timeline re-times to itself
    assert retimed_latency(base.timeline, graph, base.costs) == pytest.approx(
        base.timeline.latency)
    shaped = plan(name, W, stages=S, microbatches=8, **first_stage_backward_in_w(S))
    replay = predict_step_time(dataclasses.replace(base, costs=shaped.costs))
    assert retimed_latency(base.timeline, graph, shaped.costs) == pytest.approx(replay.latency)


@pytest.mark.parametrize(("name", "W", "S"), SPLIT)
def test_the_faster_order_at_the_true_shape_is_kept(name: str, W: int, S: int) -> None:
    true = first_stage_backward_in_w(S)
    base = plan(name, W, stages=S, microbatches=8)
    shaped = plan(name, W, stages=S, microbatches=8, **true)
    base_at_true = predict_step_time(dataclasses.replace(base, costs=shaped.costs)).latency
    chosen = first_stage_costs(ScheduleArguments(schedule=name, stages=S, microbatches=8), W)
    if chosen is None:
        assert base_at_true <= shaped.timeline.latency + 1e-9
    else:
        assert chosen == true and shaped.timeline.latency < base_at_true


def test_first_stage_costs_say_its_b_is_free_and_its_w_whole() -> None:
    costs = first_stage_backward_in_w(3)
    assert costs["backward_cost"][0] < 0.1 and costs["weight_cost"][0] == 2.0
    assert costs["backward_cost"][1:] == costs["weight_cost"][1:] == [1.0, 1.0]
    # every replica runs one pipeline's order: decided on it (G=2 here, T=2 on top)
    one = first_stage_costs(ScheduleArguments(schedule="zbv", stages=4, microbatches=8), 2)
    many = first_stage_costs(ScheduleArguments(schedule="zbv", stages=4, microbatches=8,
                                               data_parallel_size=2, tensor_parallel_size=2), 8)
    assert one == many


def test_the_engine_config_applies_it_only_at_default_costs() -> None:
    def config(**kwargs: object) -> ScheduleConfig:
        return ScheduleConfig.from_keywords(**kwargs)  # type: ignore[arg-type]

    picked = config(schedule="zbv")
    picked.plan_first_stage_backward_in_w(2)  # zbv at W=2: the true shape is faster
    assert picked.training_plan(2).costs.backward[0] < 0.1
    assert "first stage's B free" in picked.choice_text
    for kept in (config(schedule="zbv", weight_cost=1.0), config(schedule="zbv", forward_cost=2.0),
                 config(schedule="zbv", profile_costs=True), config(schedule="1f1b"),
                 config(schedule="zb-h1")):  # zb-h1 at W=2: its default order is the faster
        before = kept.training_plan(2).costs
        kept.plan_first_stage_backward_in_w(2)
        assert kept.training_plan(2).costs == before and kept.choice_text == ""


def test_large_pipelines_keep_the_default_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the lazy planning threshold the choice is not made (its re-timing would cost
    seconds): nothing is planned, the default costs stay; just below it, it is made."""
    import lightning_gsched.schedule.first_stage as first_stage

    S, B = 4, 8
    monkeypatch.setattr(first_stage, "LAZY_FROM_JOBS", 3 * S * B)  # B + 1 is above it
    planned: list[int] = []
    real = first_stage.plan_arguments
    monkeypatch.setattr(first_stage, "plan_arguments",
                        lambda *a, **k: (planned.append(1), real(*a, **k))[1])
    assert first_stage_costs(ScheduleArguments(schedule="zbv", stages=S, microbatches=B + 1),
                             2) is None
    assert planned == []
    first_stage_costs(ScheduleArguments(schedule="zbv", stages=S, microbatches=B), 2)
    assert planned == [1, 1]  # both orders planned


def test_the_memory_target_is_never_traded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the shaped order would run under other caps, or not complete under a given one,
    the default costs stay (and nothing is raised)."""
    import dataclasses as dc

    import lightning_gsched.schedule.first_stage as first_stage
    from lightning_gsched.errors import CapTooSmallError

    arguments = ScheduleArguments(schedule="zbv", stages=4, microbatches=8)
    assert first_stage_costs(arguments, 2) is not None  # taken, as above
    real = first_stage.plan_arguments

    def shaped_with(change: Any) -> Any:
        def fake(a: ScheduleArguments, *args: Any, **kwargs: Any) -> Any:
            made = real(a, *args, **kwargs)
            return change(made) if a.weight_cost is not None else made
        return fake

    monkeypatch.setattr(first_stage, "plan_arguments",
                        shaped_with(lambda p: dc.replace(p, caps=[c + 1 for c in p.caps])))
    assert first_stage_costs(arguments, 2) is None

    def refuse(_: Any) -> Any:
        raise CapTooSmallError("the shaped order cannot complete")
    monkeypatch.setattr(first_stage, "plan_arguments", shaped_with(refuse))
    assert first_stage_costs(arguments, 2) is None
