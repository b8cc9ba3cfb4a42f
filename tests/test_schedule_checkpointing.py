"""Activation checkpointing in the planner: the recompute is charged to B, the Plan records it.

``plan(..., checkpoint_activations=True | [bool per stage])``: a checkpointed stage's backward
(B's, the input-gradient part when the backward is split) costs its forward more, every other
duration is unchanged, ``Plan.checkpointed`` says which stages (also in ``to_json``), a
forward-only plan checkpoints nothing. The CLI takes ``--checkpoint-activations`` (every stage)
or ``--checkpoint-stages``, and the startup summary names the checkpointed stages with a
``gsched plan`` command that rebuilds the same plan.
"""

from __future__ import annotations

import json

import pytest

from lightning_gsched.cli import main
from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import Phase, plan, predict_step_time
from lightning_gsched.schedule.arguments import ScheduleArguments
from lightning_gsched.schedule.describe import describe, plan_command, startup_summary


def durations(result) -> dict[tuple[int, Phase], set[float]]:
    """Every (stage, phase)'s durations in the timeline."""
    out: dict[tuple[int, Phase], set[float]] = {}
    for slot in result.timeline.slots:
        out.setdefault((slot.job.stage, slot.job.phase), set()).add(slot.end - slot.start)
    return out


@pytest.mark.parametrize("schedule, flags", [
    ("1f1b", [False, True]), ("interleaved", [True, False, True, False]),
    ("zb-h1", [True, False]), ("zbv", [False, True, True, False]),
])
def test_backward_grows_by_the_forward_on_checkpointed_stages(schedule, flags):
    S = len(flags)
    forward = [1.0 + 0.5 * s for s in range(S)]  # uneven: the charge is each stage's own F
    backward = [2.0 + 0.25 * s for s in range(S)]
    split = schedule.startswith("zb")
    weight = [0.75] * S if split else None
    kwargs = dict(workers=2, stages=S, forward_cost=forward, backward_cost=backward,
                  weight_cost=weight)
    plain = plan(schedule, **kwargs)
    ckpt = plan(schedule, checkpoint_activations=flags, **kwargs)
    assert plain.checkpointed == (False,) * S and ckpt.checkpointed == tuple(flags)
    times, base = durations(ckpt), durations(plain)
    for s in range(S):
        assert times[(s, Phase.F)] == {forward[s]}
        want = backward[s] + forward[s] if flags[s] else backward[s]
        assert times[(s, Phase.B)] == {want}, (s, times[(s, Phase.B)])
        assert base[(s, Phase.B)] == {backward[s]}
        if split:  # W reuses B's graph: its cost does not change
            assert times[(s, Phase.W)] == base[(s, Phase.W)] == {0.75}
    # more work in the same order cannot finish earlier; the replay costs what the plan says
    assert ckpt.metrics.latency > plain.metrics.latency
    assert predict_step_time(ckpt).latency == pytest.approx(ckpt.metrics.latency)
    data = ckpt.to_json()
    assert data["checkpointed"] == flags
    assert data["backward_costs"] == [b + f if c else b
                                      for b, f, c in zip(backward, forward, flags, strict=True)]


def test_gpipe_latency_follows_the_textbook_formula():
    """GPipe's step is (B + S - 1)(f + b); with every stage checkpointed b becomes b + f."""
    for B in (2, 4):
        assert plan("gpipe", workers=2, microbatches=B).metrics.latency == (B + 1) * 3
        ckpt = plan("gpipe", workers=2, microbatches=B, checkpoint_activations=True)
        assert ckpt.metrics.latency == (B + 1) * 4


def test_true_means_every_stage_and_forward_only_checkpoints_nothing():
    result = plan("zbv", workers=2, checkpoint_activations=True)
    assert result.checkpointed == (True,) * result.stages
    evaluation = plan("zbv", workers=2, checkpoint_activations=True, forward_only=True)
    assert evaluation.checkpointed == (False,) * evaluation.stages
    assert evaluation.to_json()["checkpointed"] == [False] * evaluation.stages
    assert plan("zbv", workers=2).checkpointed == (False,) * result.stages


@pytest.mark.parametrize("value, message", [
    (1, "checkpoint_activations=1 is not valid"),
    ("yes", "checkpoint_activations='yes' is not valid"),
    ([True, "no"], "checkpoint_activations[1]='no' is not valid"),
    ([], "checkpoint_activations has 0 values"),
    ([True, False, True], "checkpoint_activations has 3 values but needs S=2"),
])
def test_bad_flags_are_refused_naming_the_argument(value, message):
    with pytest.raises(ScheduleConfigError, match=message.replace("[", r"\[")):
        plan("1f1b", workers=2, checkpoint_activations=value)


def test_length_is_checked_when_the_number_of_stages_is_known():
    """Without stages= the schedule's default S decides (needs W): construction lets a list of
    any length through, plan() then checks it; with stages= it is checked at once."""
    ScheduleArguments("1f1b", checkpoint_activations=[True] * 3)
    with pytest.raises(ScheduleConfigError, match="has 3 values but needs S=2"):
        ScheduleArguments("1f1b", stages=2, checkpoint_activations=[True] * 3)
    with pytest.raises(ScheduleConfigError, match="has 3 values but needs S=4"):
        plan("1f1b", workers=4, checkpoint_activations=[True] * 3)


def test_cli_checkpoint_activations_and_stages(capsys):
    assert main(["plan", "1f1b", "-w", "2", "--checkpoint-activations", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["checkpointed"] == [True, True] and data["backward_costs"] == [3.0, 3.0]
    assert main(["plan", "zbv", "-w", "2", "--checkpoint-stages", "0,2-3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["checkpointed"] == [True, False, True, True]
    assert data["backward_costs"] == [2.0, 1.0, 2.0, 2.0]  # zbv: B = W = 1 by default
    assert main(["plan", "zbv", "-w", "2", "--checkpoint-stages", "1"]) == 0
    assert "checkpointed=1" in capsys.readouterr().out.splitlines()[0]
    assert main(["plan", "zbv", "-w", "2", "--checkpoint-stages", "4"]) == 2
    assert "names stages [4], but the plan has S=4 stages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "zbv", "-w", "2", "--checkpoint-stages", "2-1"])
    assert "--checkpoint-stages '2-1' is not valid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "zbv", "-w", "2", "--checkpoint-stages", "1", "--checkpoint-activations"])
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize("schedule, kwargs", [
    ("1f1b", dict(workers=4, checkpoint_activations=True)),
    ("zbv", dict(workers=2, checkpoint_activations=[True, False, False, True],
                 forward_cost=1.5, backward_cost=1.1, weight_cost=0.7)),
    ("interleaved", dict(workers=2, checkpoint_activations=[False, True, True, True],
                         forward_cost=[1.0, 1.1, 1.2, 1.3])),
])
def test_startup_summary_names_the_stages_and_its_command_rebuilds_the_plan(
        schedule, kwargs, capsys):
    result = plan(schedule, **kwargs)
    command = plan_command(result)
    text = startup_summary(result, [1000] * result.stages, 0, command)
    flags = result.checkpointed
    which = ("every stage" if all(flags) else
             "stages " + {(True, False, False, True): "0,3",
                          (False, True, True, True): "1-3"}[flags])
    assert f"activation checkpointing on {which}: F keeps only the stage's inputs" in text
    assert main(command.split()[1:] + ["--json"]) == 0  # the same plan from the command line
    data = json.loads(capsys.readouterr().out)
    assert data["checkpointed"] == list(flags)
    assert data["backward_costs"] == pytest.approx(list(result.costs.backward))
    assert data["latency"] == pytest.approx(result.metrics.latency)
    configuration = text.splitlines()[0].removeprefix(f"GeneralParallel plan: {schedule} ")
    assert describe(result).splitlines()[0] == f"schedule {schedule}: {configuration}"
    assert "checkpointed=" in configuration


def test_no_checkpointing_changes_no_summary():
    result = plan("1f1b", workers=2)
    text = startup_summary(result, [1000, 1000], 0, plan_command(result))
    assert "checkpoint" not in text and "checkpoint" not in describe(result)
