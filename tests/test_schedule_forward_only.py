"""Forward-only plans (validation, test, predict): F jobs only, same owners as training."""

from __future__ import annotations

import json
from collections import defaultdict
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings

from lightning_gsched.cli import main
from lightning_gsched.errors import ProgramError, RuntimeConfigError
from lightning_gsched.runtime import stage_micros
from lightning_gsched.runtime.layout import check_forward_programs
from lightning_gsched.schedule import LIBRARY, Op, Phase, Programs, StageGraph, dry_run, plan
from lightning_gsched.schedule.program import BACKWARD_OPS, COMPUTE_OPS, FORWARD_ONLY_OPS
from test_schedule_properties import configs

ZERO_IN_FORWARD = ["input_grad_recvs", "input_grad_sends", "grad_sends", "grad_recvs",
                   "allreduces", "peak_activations"]


def check_forward_only_plan(result, train_owners) -> None:
    """What every forward-only plan must satisfy (used by the table and the property test)."""
    W, S, B = result.workers, result.stages, result.micro
    assert result.forward_only and result.programs.forward_only
    assert result.caps == [None] * W
    # owners as in training: the same executor runs both
    assert result.table.owners == train_owners
    assert result.programs.owners == list(train_owners)
    # every forward exactly once, on its compute worker, after its inputs; nothing else
    slots = result.timeline.slots
    by_job = {slot.job: slot for slot in slots}
    assert len(slots) == S * B == len(by_job)
    graph = StageGraph(S, forward_only=True)
    for slot in slots:
        s, b, d = slot.job
        assert d is Phase.F and slot.worker == result.table.compute[s][b]
        for pred in graph.pred(slot.job):
            assert by_job[pred].end <= slot.start + 1e-9
    for worker_slots in result.timeline.by_worker:
        ordered = sorted(worker_slots, key=lambda x: x.start)
        assert all(a.end <= z.start + 1e-9 for a, z in pairwise(ordered))
    # programs: only forward-only ops, the timeline's compute order, dry run passes
    for w, program in enumerate(result.programs.ranks):
        assert {a.op for a in program} <= FORWARD_ONLY_OPS, program
        computes = [(a.stage, a.micro) for a in program if a.op in COMPUTE_OPS]
        assert computes == [(x.job.stage, x.job.micro) for x in result.timeline.by_worker[w]]
    dry_run(result.programs)
    # metrics: no backward traffic, activations as the placement implies
    for m in result.metrics.per_worker:
        assert all(getattr(m, f) == 0 for f in ZERO_IN_FORWARD), m
        assert m.activation_recvs == sum(
            1 for s in range(1, S) for b in range(B)
            if result.table.compute[s][b] == m.worker and result.table.compute[s - 1][b] != m.worker
        )
        foreign = {x.job.stage for x in result.timeline.by_worker[m.worker]}
        foreign -= set(result.table.owned_stages(m.worker))
        assert m.weight_fetches >= len(foreign)
        assert m.peak_resident_stages >= m.owned_stages
    # every microbatch enters on exactly one rank and leaves on exactly one rank
    firsts = [b for r in range(W) for b in stage_micros(result.programs, r)[0]]
    lasts = [b for r in range(W) for b in stage_micros(result.programs, r)[1]]
    assert sorted(firsts) == sorted(lasts) == list(range(B))


@pytest.mark.parametrize("name", list(LIBRARY))
@pytest.mark.parametrize("W", [1, 2, 4, 6])
def test_library_schedules_forward_only(name, W):
    train = plan(name, workers=W)
    result = plan(name, workers=W, forward_only=True)
    assert (result.stages, result.micro, result.R) == (train.stages, train.micro, train.R)
    check_forward_only_plan(result, train.table.owners)
    # a different number of microbatches keeps the owners (eval batches differ from training)
    other = plan(name, workers=W, stages=train.stages, R=train.R, forward_only=True,
                 microbatches=2 * train.micro)
    check_forward_only_plan(other, train.table.owners)
    check_forward_programs(train.programs, other.programs)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_every_forward_only_plan_is_valid(config):
    result = plan(**config, forward_only=True)  # the cap (even a tiny one) is ignored
    # owners equal those of the training plan of the same configuration
    check_forward_only_plan(result, plan(**{**config, "cap": None}).table.owners)
    costs = config["forward_cost"]
    busy = defaultdict(float)
    for slot in result.timeline.slots:
        assert abs((slot.end - slot.start) - costs[slot.job.stage]) < 1e-9
        busy[slot.worker] += slot.end - slot.start
    for m in result.metrics.per_worker:
        assert abs(m.busy - busy[m.worker]) < 1e-9


def test_forward_only_owner_without_backward_gets_no_allreduce():
    """lpp replicas: training all-reduces every replicated stage (even on a replica owner with no
    backward of it); forward-only programs never do."""
    train = plan("lpp", workers=4)
    assert any(a.op is Op.ALLREDUCE_G for p in train.programs.ranks for a in p)
    result = plan("lpp", workers=4, forward_only=True)
    assert not any(a.op in BACKWARD_OPS for p in result.programs.ranks for a in p)


def test_fsdp_forward_only_fetches_each_foreign_stage_once():
    result = plan("fsdp", workers=4, forward_only=True)
    for m in result.metrics.per_worker:
        assert m.weight_fetches == 3 and m.weight_serves == 3
        assert m.peak_resident_stages == 3  # owned + the stage computing + the one prefetched
    assert result.metrics.latency == 4  # S forwards of cost 1, no bubble (B = W)


def test_custom_placement_forward_only():
    result = plan(placement=lambda s, b, d: (s % 2, (s + b) % 2), workers=2, stages=4,
                  microbatches=4, forward_only=True)
    train = plan(placement=lambda s, b, d: (s % 2, (s + b) % 2), workers=2, stages=4,
                 microbatches=4)
    check_forward_only_plan(result, train.table.owners)


def test_dry_run_rejects_backward_ops_in_forward_only_programs():
    train = plan("gpipe", workers=2).programs
    fake = Programs(train.ranks, train.num_stages, train.num_micro, train.owners, train.edges,
                    forward_only=True)
    with pytest.raises(ProgramError, match="forward-only programs contain only"):
        dry_run(fake)


def test_forward_only_graph_has_no_backward_jobs():
    graph = StageGraph(3, forward_only=True)
    assert graph.succ((2, 0, Phase.F)) == []
    assert [j.phase for j in graph.all_jobs(2)] == [Phase.F] * 6
    with pytest.raises(Exception, match="forward-only graph has no B jobs"):
        graph.pred((1, 0, Phase.B))


def test_check_forward_programs_names_the_fix():
    train = plan("fslpp", workers=4)
    cases = [
        (train.programs, "forward_only=True"),
        (plan("fslpp", workers=2, forward_only=True).programs, "2 workers instead of 4"),
        (plan("fslpp", workers=4, stages=8, forward_only=True).programs, "8 stages instead of 4"),
        (plan("lpp", workers=4, stages=4, forward_only=True).programs, "stage owners"),
    ]
    for programs, text in cases:
        with pytest.raises(RuntimeConfigError, match=text) as info:
            check_forward_programs(train.programs, programs)
        assert "plan(" in str(info.value)
    check_forward_programs(train.programs, plan("fslpp", workers=4, microbatches=4,
                                                forward_only=True).programs)


def test_stage_micros():
    p = plan("gpipe", workers=2, forward_only=True)
    assert stage_micros(p.programs, 0) == (list(range(4)), [])
    assert stage_micros(p.programs, 1) == ([], list(range(4)))
    d = plan("ddp", workers=2, stages=2)
    assert stage_micros(d.programs, 1) == ([1], [1])


def test_cli_forward_only(capsys):
    assert main(["plan", "interleaved", "-w", "4", "--forward-only", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["forward_only"] is True and data["caps"] == [None] * 4
    assert {t["phase"] for t in data["timeline"]} == {"F"}
    assert len(data["timeline"]) == data["stages"] * data["microbatches"]
    assert all(not a.startswith(("B ", "SEND_GRAD", "RECV_GRAD", "REDUCE_G", "RECV_G", "ALLREDUCE"))
               for program in data["programs"] for a in program)
    assert main(["plan", "fsdp", "-w", "2", "--forward-only", "--programs"]) == 0
    out = capsys.readouterr().out
    assert "forward-only" in out and "FETCH_W s1 <-1" in out and "B s" not in out
    assert main(["plan", "fsdp", "-w", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["forward_only"] is False
