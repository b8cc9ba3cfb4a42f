"""Zero-bubble schedules (W phase): the paper's figures, the W job's rules, and the dry run.

The figures are the targets of issue 12 with unit costs F = B = W = 1 (1F1B: backward 2): p
workers, m microbatches. Where the greedy scheduler cannot reach a figure, docs/schedules.md says
by how much and why; the assertions here are those documented bounds.
"""

from __future__ import annotations

import pytest

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.dryrun import dry_run
from lightning_gsched.schedule.jobs import Phase
from lightning_gsched.schedule.predict import predict_step_time
from lightning_gsched.schedule.program import Action, Op, Programs
from lightning_gsched.schedule.runtime_costs import RuntimeCosts

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (2 * p, 4 * p)]
UNIT = {"backward_cost": 1.0, "weight_cost": 1.0}


def _peak(result) -> int:
    return int(result.metrics.max_of("peak_activations"))


@pytest.mark.parametrize("p,m", GRID)
def test_paper_figures(p: int, m: int) -> None:
    one = plan("1f1b", p, microbatches=m)
    h1 = plan("zb-h1", p, microbatches=m, **UNIT)
    h2 = plan("zb-h2", p, microbatches=m, **UNIT)
    v = plan("zbv", p, microbatches=m, **UNIT)
    assert one.metrics.latency == 3 * (m + p - 1)
    # zb-h1: the paper's 3m + p - 1 for p = 2, at most two units more beyond (documented), and
    # never above 1F1B's largest stash
    assert 3 * m + p - 1 <= h1.metrics.latency <= 3 * m + p + 1
    assert h1.metrics.latency < one.metrics.latency
    assert _peak(h1) <= _peak(one)
    # zb-h2: the lower bound of the placement (last worker idle for p - 1 forwards, then 3m)
    assert h2.metrics.latency == 3 * m + p - 1
    assert _peak(h2) <= 2 * p - 1
    # zbv: within 10% of the work bound 6m, at most 2p stage-chunks stashed
    assert 6 * m <= v.metrics.latency <= 1.10 * 6 * m
    assert _peak(v) <= 2 * p


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zbv"])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_w_follows_its_b_on_the_same_worker(schedule: str, W: int) -> None:
    result = plan(schedule, W)
    slots = {(s.job.stage, s.job.micro, s.job.phase): s for s in result.timeline.slots}
    for s in range(result.stages):
        for b in range(result.micro):
            back, weight = slots[(s, b, Phase.B)], slots[(s, b, Phase.W)]
            assert weight.worker == back.worker
            assert weight.start >= back.end
    # the programs hold exactly one W per (stage, microbatch), after its B on that rank
    for program in result.programs.ranks:
        seen_b = set()
        for action in program:
            if action.op is Op.B:
                seen_b.add((action.stage, action.micro))
            elif action.op is Op.W:
                assert (action.stage, action.micro) in seen_b, action
    ws = [a for p in result.programs.ranks for a in p if a.op is Op.W]
    assert len(ws) == result.stages * result.micro


def test_w_fills_bubbles_only_when_split() -> None:
    """The same placement and order without a split backward has no W and is 1F1B-like."""
    split = plan("zb-h1", 4, microbatches=8)
    whole = plan("zb-h1", 4, microbatches=8, split_backward=False)
    assert not any(a.op is Op.W for p in whole.programs.ranks for a in p)
    assert whole.metrics.latency > split.metrics.latency
    assert [s.job.phase for s in whole.timeline.slots].count(Phase.W) == 0


def test_weight_cost_is_charged_to_w() -> None:
    cheap = plan("zb-h1", 2, microbatches=4, backward_cost=1.0, weight_cost=0.5)
    dear = plan("zb-h1", 2, microbatches=4, backward_cost=1.0, weight_cost=2.0)
    for result, cost in ((cheap, 0.5), (dear, 2.0)):
        ws = [s for s in result.timeline.slots if s.job.phase is Phase.W]
        assert all(s.end - s.start == cost for s in ws)
    assert dear.metrics.latency > cheap.metrics.latency
    # no weight_cost: the backward cost is halved between B and W
    halved = plan("zb-h1", 2, microbatches=4, backward_cost=3.0)
    assert set(halved.costs.backward) == {1.5} and set(halved.costs.weight) == {1.5}


def test_weight_cost_without_split_is_refused() -> None:
    from lightning_gsched.errors import ScheduleConfigError

    with pytest.raises(ScheduleConfigError, match="weight_cost"):
        plan("1f1b", 2, weight_cost=1.0)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zbv"])
def test_replay_with_no_communication_equals_latency(schedule: str) -> None:
    result = plan(schedule, 4, backward_cost=[1, 2, 1, 3] * (2 if schedule == "zbv" else 1),
                  weight_cost=0.7)
    assert predict_step_time(result).latency == pytest.approx(result.metrics.latency)
    slow = RuntimeCosts(latency=0.1)
    assert predict_step_time(result, costs=slow).latency > result.metrics.latency


def test_forward_only_plans_of_zero_bubble_schedules_have_no_w() -> None:
    result = plan("zbv", 2, forward_only=True)
    assert not result.programs.split_backward
    assert {a.op for p in result.programs.ranks for a in p} <= {Op.F, Op.SEND_ACT, Op.RECV_ACT}


def _split_programs(ranks: list[list[str]]) -> Programs:
    return Programs([[Action.parse(t) for t in r] for r in ranks], num_stages=1, num_micro=1,
                    owners=[(0,)], edges=[], split_backward=True)


def test_dry_run_checks_w() -> None:
    dry_run(_split_programs([["F s0 b0", "B s0 b0", "W s0 b0"]]))
    with pytest.raises(ProgramError, match="before B s0 b0"):
        dry_run(_split_programs([["F s0 b0", "W s0 b0", "B s0 b0"]]))
    with pytest.raises(ProgramError, match="stashed activations"):
        dry_run(_split_programs([["F s0 b0", "B s0 b0"]]))  # W missing: the stash is never freed
    whole = Programs([[Action.parse(t) for t in ("F s0 b0", "B s0 b0", "W s0 b0")]], 1, 1,
                     [(0,)], [])
    with pytest.raises(ProgramError, match="do not split the backward"):
        dry_run(whole)


def test_action_text_round_trips_w() -> None:
    assert str(Action.parse("W s3 b1")) == "W s3 b1"
    assert Action.parse("W s3 b1").op is Op.W


def test_cli_plans_zero_bubble_with_weight_cost(capsys) -> None:
    import json

    from lightning_gsched.cli import main

    assert main(["plan", "zb-h1", "-w", "2", "--backward-cost", "1", "--weight-cost", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["split_backward"] is True and out["weight_costs"] == [1.0, 1.0]
    assert {row["phase"] for row in out["timeline"]} == {"F", "B", "W"}
    assert any(a.startswith("W s") for program in out["programs"] for a in program)
