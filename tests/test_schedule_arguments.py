"""One arguments type: ``ScheduleArguments`` is validated once and every entry point takes it.

The front ends pass their keywords on by name (``pipeline_keywords(locals())``), so a field their
``__init__`` does not spell out would silently keep its default: these tests catch that.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import ScheduleArguments, plan
from lightning_gsched.schedule.plan import plan_arguments

FRONT_END_ONLY_PLANNER = {"ties"}  # learnt from the partition, never a constructor argument


def test_plan_takes_every_argument_by_keyword():
    assert set(ScheduleArguments.names()) <= set(inspect.signature(plan).parameters)


@pytest.mark.parametrize("front_end", ["lightning", "fabric"])
def test_front_ends_spell_out_every_argument(front_end):
    if front_end == "lightning":
        from lightning_gsched.lightning.strategy import GeneralParallel as cls
    else:
        from lightning_gsched.fabric.strategy import GeneralParallelFabric as cls
    parameters = inspect.signature(cls.__init__).parameters
    missing = set(ScheduleArguments.names()) - FRONT_END_ONLY_PLANNER - set(parameters)
    assert not missing
    defaults = ScheduleArguments.defaults()
    for name in set(ScheduleArguments.names()) - FRONT_END_ONLY_PLANNER:
        if name != "schedule":
            assert parameters[name].default == defaults[name], name


def test_frozen_and_validated_at_construction():
    arguments = ScheduleArguments("1f1b", stages=2, microbatches=4)
    assert arguments.stages == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        arguments.stages = 3  # type: ignore[misc]
    with pytest.raises(ScheduleConfigError, match="microbatches=0"):
        arguments.replace(microbatches=0)
    with pytest.raises(ScheduleConfigError, match="fetch_window"):
        ScheduleArguments("fsdp", fetch_window=0)


def test_plan_arguments_is_plan():
    direct = plan("fslpp", workers=4, R=2, checkpoint_activations=True)
    given = plan_arguments(ScheduleArguments("fslpp", R=2, checkpoint_activations=True), 4)
    assert given.to_json() == direct.to_json()
