"""The program IR's text form and the dry run's ability to reject broken programs."""

from __future__ import annotations

import copy

import pytest

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule import Action, Op, dry_run, plan
from planner_references import plan_general_graph


@pytest.mark.parametrize("name", ["ddp", "fsdp", "1f1b", "interleaved", "fslpp"])
def test_text_form_round_trips(name):
    result = plan(name, workers=4)
    for program in result.programs.ranks:
        for action in program:
            assert Action.parse(str(action)) == action


def test_text_examples():
    assert str(Action(Op.SEND_ACT, 3, 1, 2)) == "SEND_ACT s3 b1 ->2"
    assert str(Action(Op.RECV_GRAD, 4, 1, 3)) == "RECV_GRAD s4 b1 <-3"
    assert str(Action(Op.FETCH_W, 5, None, 1)) == "FETCH_W s5 <-1"
    assert str(Action(Op.ALLREDUCE_G, 5, None, None, (0, 2))) == "ALLREDUCE_G s5 [0,2]"
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("JUMP s1")


def _mutated(result, rank, edit):
    programs = copy.deepcopy(result.programs)
    edit(programs.ranks[rank])
    return programs


def _index(program, text):
    return [str(a) for a in program].index(text)


def test_dry_run_rejects_a_missing_receive():
    result = plan("gpipe", workers=2, microbatches=2)
    broken = _mutated(result, 1, lambda p: p.pop(_index(p, "RECV_ACT s0 b0 <-0")))
    with pytest.raises(ProgramError, match="never receives it"):
        dry_run(broken)


def test_dry_run_rejects_out_of_order_channel():
    result = plan("gpipe", workers=2, microbatches=2)

    def swap(p):
        i, j = _index(p, "RECV_ACT s0 b0 <-0"), _index(p, "RECV_ACT s0 b1 <-0")
        p[i], p[j] = p[j], p[i]

    with pytest.raises(ProgramError, match="out of order"):
        dry_run(_mutated(result, 1, swap))


def test_dry_run_rejects_unfreed_weights_and_compute_without_weights():
    result = plan("fsdp", workers=2)
    leak = _mutated(result, 0, lambda p: p.pop(next(i for i, a in enumerate(p) if a.op is Op.FREE_W)))
    with pytest.raises(ProgramError, match="never freed|already resident"):
        dry_run(leak)

    def drop_fetch(p):
        i = next(i for i, a in enumerate(p) if a.op is Op.FETCH_W)
        stage, peer = p[i].stage, p[i].peer
        p.pop(i)
        return stage, peer

    programs = copy.deepcopy(result.programs)
    stage, owner = drop_fetch(programs.ranks[0])
    serve = next(i for i, a in enumerate(programs.ranks[owner]) if a.op is Op.SEND_W and a.stage == stage)
    programs.ranks[owner].pop(serve)
    with pytest.raises(ProgramError, match=f"has no weights of stage {stage}"):
        dry_run(programs)


def test_dry_run_detects_a_deadlock():
    # Rank 0 holds back the activation of b0 until after the backward of b0, which needs the
    # gradient rank 1 can only produce from that activation: a cycle of waits.
    result = plan("gpipe", workers=2, microbatches=1)  # one message per channel: order is moot

    def delay_send(p):
        p.append(p.pop(_index(p, "SEND_ACT s0 b0 ->1")))

    with pytest.raises(ProgramError, match=r"programs deadlock: rank 0 waits at 'B s0 b\d'; rank 1 waits at 'F s1 b0'"):
        dry_run(_mutated(result, 0, delay_send))


def test_dry_run_rejects_backward_before_forward():
    result = plan("ddp", workers=1, stages=2, microbatches=1)

    def swap(p):
        i, j = _index(p, "F s1 b0"), _index(p, "B s1 b0")
        p[i], p[j] = p[j], p[i]

    with pytest.raises(ProgramError, match="without the stashed forward"):
        dry_run(_mutated(result, 0, swap))


def test_fetched_stage_stays_resident_over_consecutive_uses():
    result = plan("fsdp", workers=2, stages=2, microbatches=4)  # 2 microbatches per worker
    program = [str(a) for a in result.programs.ranks[0]]
    # Worker 0 owns stage 0. Under bfs it runs F s1 for both its microbatches and then, s1 being
    # the last stage, both B s1: four consecutive uses, so one fetch, one free, one reduce.
    assert program.count("FETCH_W s1 <-1") == 1 and program.count("REDUCE_G s1 ->1") == 1
    fetch, free = program.index("FETCH_W s1 <-1"), program.index("FREE_W s1")
    uses = [a for a in program[fetch:free] if a.startswith(("F s1", "B s1"))]
    assert sorted(uses) == ["B s1 b0", "B s1 b2", "F s1 b0", "F s1 b2"]


def test_dag_of_stages_two_encoder_legs_feeding_one_head():
    """Stages 0 and 1 are independent legs, stage 2 consumes both: pred/succ come from the graph."""
    edges = [(0, 2), (1, 2)]
    result = plan_general_graph(edges, placement=lambda s, b, d: (s, s), workers=3, stages=3,
                                microbatches=4, order="bfs")
    by_job = {(x.job.stage, x.job.micro, x.job.phase.value): x for x in result.timeline.slots}
    for b in range(4):
        head_forward = by_job[(2, b, "F")]
        assert head_forward.start >= max(by_job[(0, b, "F")].end, by_job[(1, b, "F")].end)
        assert by_job[(0, b, "B")].start >= by_job[(2, b, "B")].end
        assert by_job[(1, b, "B")].start >= by_job[(2, b, "B")].end
    head = [str(a) for a in result.programs.ranks[2]]
    assert "RECV_ACT s0 b0 <-0" in head and "RECV_ACT s1 b0 <-1" in head
    assert "SEND_GRAD s2 b0 ->0" in head and "SEND_GRAD s2 b0 ->1" in head
    assert result.metrics.per_worker[2].activation_recvs == 2 * 4
    # the legs run in parallel: latency is one leg + head, not two legs + head
    assert result.metrics.latency < 4 * 3 + 4 * 3 + 3 * 3


@pytest.mark.parametrize("unit", ["s99", "t7"])
def test_dry_run_names_a_weight_unit_past_the_last_stage(unit):
    """A matched fetch of a unit the programs do not have: a ProgramError naming it (was a bare
    IndexError from the dry run's per-stage tables)."""
    result = plan("fsdp", workers=2)
    broken = copy.deepcopy(result.programs)
    broken.ranks[0].insert(0, Action.parse(f"FETCH_W {unit} <-1"))
    broken.ranks[1].insert(0, Action.parse(f"SEND_W {unit} ->0"))
    with pytest.raises(ProgramError, match=rf"rank [01] at action 0 .*names (stage|tie) "
                                           rf"{unit[1:]}; these programs have stages 0 to 1"):
        dry_run(broken)
