"""The consumption rules (schedule/consumption.py) are the ones every reader of programs uses.

Why: the dry run, the time replay, the bytes walk and the runtime's step each decide which
inputs a compute reads and which op ends a stash; they used to write that down each, and the
copies disagreed (two followed the stage graph, two assumed a chain). These tests hold them to
the one set of rules, and hold ``plan()`` to refusing the graphs the runtime cannot run.
"""

from __future__ import annotations

import pytest

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule import LIBRARY, plan
from lightning_gsched.schedule import predict as predict_module
from lightning_gsched.schedule.consumption import OpRules, unit_of
from lightning_gsched.schedule.dryrun import Shared
from lightning_gsched.schedule.jobs import Job, Phase, StageGraph
from lightning_gsched.schedule.memory import RankWalk
from lightning_gsched.schedule.program import COMPUTE_OPS, Op
from lightning_gsched.schedule.runtime_costs import RuntimeCosts
from planner_references import plan_general_graph
from sizes import uniform_sizes

_TABLES = ("act_from", "grad_from", "ties_read", "units_read", "stash_op", "weight_grad_op")


def _tables(rules: OpRules) -> tuple:
    return tuple(getattr(rules, name) for name in _TABLES)


def _library_plans():
    for name in sorted(LIBRARY):
        for W in (2, 3, 4):
            S = 2 * W if name in ("zbv", "v-half", "v-min", "interleaved") else W
            for kwargs in ({}, {"forward_only": True}, {"ties": {0: (0, S - 1)}}):
                yield pytest.param(name, W, S, kwargs, id=f"{name}-W{W}-{'-'.join(kwargs)}")


@pytest.mark.parametrize("name,W,S,kwargs", list(_library_plans()))
def test_the_readers_use_one_set_of_rules(name, W, S, kwargs, monkeypatch):
    try:
        result = plan(name, workers=W, stages=S, microbatches=2 * W, **kwargs)
    except GschedError as exc:  # a shape this schedule does not take
        pytest.skip(str(exc))
    programs = result.programs
    rules = OpRules.of(programs)
    # the rules are the stage graph's dependencies, as the simulator and lowering use them
    graph = StageGraph(S, programs.edges, programs.forward_only, programs.split_backward)
    for job in graph.all_jobs(1):
        assert rules.reads(Op(job.phase.value), job.stage) == tuple(
            (p.phase, p.stage) for p in graph.pred(job))
    assert rules.weight_grad_op is programs.weight_grad_op
    # the dry run and the bytes walk read the same tables
    assert _tables(Shared(programs).rules) == _tables(rules)
    sizes = uniform_sizes(S, 10, 100, 7, ties=programs.ties, tie_params=3)
    for rank in range(W):
        walk = RankWalk(programs, sizes, rank, [False] * S)
        assert _tables(walk.rules) == _tables(rules)
        # every posted activation / input-gradient is consumed by a compute, per the rules
        for action in programs.ranks[rank]:
            walk.apply(action)
        assert not [k for k in walk.posted if k[0] in (Op.RECV_ACT, Op.RECV_GRAD)]
        assert not walk.stashed or programs.forward_only
    # the time replay asks the rules what each compute reads (again after each wait)
    calls = []
    real = OpRules.reads
    monkeypatch.setattr(OpRules, "reads", lambda self, op, s: calls.append(op) or real(self, op, s))
    predict_module.predict_step_time(result, costs=RuntimeCosts(latency=1.0))
    computes = [a.op for p in programs.ranks for a in p if a.op in COMPUTE_OPS]
    assert set(calls) == set(computes) and len(calls) >= len(computes)


def test_what_a_compute_reads_on_a_general_graph():
    rules = OpRules(StageGraph(4, [(0, 2), (1, 2), (0, 3), (2, 3)], split_backward=True),
                    ties={0: (0, 3)})
    assert rules.act_from[2] == (0, 1) and rules.grad_from[0] == (2, 3)
    assert rules.reads(Op.B, 3) == ((Phase.F, 3),)  # a sink starts from its own loss
    assert rules.reads(Op.W, 1) == ((Phase.B, 1),)
    assert rules.units_read[3] == ((3, False), (0, True))  # its stage, then tie 0
    assert rules.weight_grad_op is Op.W  # W, not B, ends a split backward's stash
    from lightning_gsched.schedule.program import Action, Message

    assert rules.messages_read(Action(Op.F, 2, 5)) == [Message(Op.RECV_ACT, 0, 5),
                                                       Message(Op.RECV_ACT, 1, 5)]
    assert rules.messages_read(Action(Op.B, 0, 1)) == [Message(Op.RECV_GRAD, 2, 1),
                                                       Message(Op.RECV_GRAD, 3, 1)]
    assert unit_of(Action.parse("FREE_W t0")) == (0, True)
    assert Job(2, 0, Phase.F) in StageGraph(4, [(0, 2), (1, 2), (0, 3), (2, 3)]).succ(
        Job(1, 0, Phase.F))


@pytest.mark.parametrize("split", [False, True])
def test_the_bytes_walk_follows_a_general_graph(split):
    """memory.py used to assume s-1 / s+1: a general graph's receives were never consumed."""
    edges = [(0, 2), (1, 2), (0, 3), (2, 3)]
    result = plan_general_graph(edges, workers=3, stages=4, microbatches=4, split_backward=split,
                                placement=lambda s, b, d: (s % 3, (s + b) % 3))
    programs = result.programs
    sizes = uniform_sizes(4, 10, 100, 7)
    for rank in range(3):
        walk = RankWalk(programs, sizes, rank, [False] * 4)
        for action in programs.ranks[rank]:
            walk.apply(action)
        assert not [k for k in walk.posted if k[0] in (Op.RECV_ACT, Op.RECV_GRAD)]
        assert walk.activations == 0 and not walk.stashed


@pytest.mark.parametrize("edges", [[(0, 2), (1, 2)], [(0, 1), (0, 2), (1, 2)], [(0, 1)]])
def test_plan_refuses_a_graph_that_is_not_a_chain(edges):
    with pytest.raises(ScheduleConfigError, match=r"not the chain of 3 stages.*leave out edges="):
        plan("1f1b", workers=3, stages=3, edges=edges)


def test_plan_takes_the_chain_given_as_edges_and_names_an_invalid_edge():
    chain = plan("1f1b", workers=3, stages=3, edges=[(1, 2), (0, 1)])
    assert chain.programs.ranks == plan("1f1b", workers=3, stages=3).programs.ranks
    with pytest.raises(ScheduleConfigError, match=r"stage edge \(2, 1\) is invalid"):
        plan("1f1b", workers=3, stages=3, edges=[(0, 1), (2, 1)])
