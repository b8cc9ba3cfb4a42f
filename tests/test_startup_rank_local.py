"""A rank's start-up reads only its own program (issue 26: plans for 1,024 ranks).

What each rank decides or reports at start-up from its own program (or from the plan's
tables) must equal what the full path, reading every rank's program, gives: the replica
subgroups (identical on every rank: ``dist.new_group`` is collective), whether a rank's
step needs the inputs' signature, the forward-only check, the memory prediction and the
start-up summary's rows. And for a plan lowered per rank (``schedule/lazy_ranks.py``), those
start-up functions lower only the rank's own program. No processes: these are the pure
functions the runtime and the engine call.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_gsched.runtime.channels import owner_groups, replica_groups
from lightning_gsched.runtime.executor import ProgramExecutor
from lightning_gsched.runtime.layout import check_forward_programs
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.describe import startup_row, startup_summary
from lightning_gsched.schedule.lazy_ranks import LazyList
from lightning_gsched.schedule.memory import (
    ModelSizes,
    StageSizes,
    TieSizes,
    predict_memory,
    resident_bytes,
)
from lightning_gsched.schedule.plan import Plan
from lightning_gsched.schedule.program import Op, Programs

plan_module = sys.modules["lightning_gsched.schedule.plan"]  # the package exports plan()

# (schedule, W, plan keywords): every family of the library, a tie, replicas, a split backward
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("ddp", 4, {}), ("fsdp", 4, {}), ("fsdp", 8, {}), ("gpipe", 4, {}), ("1f1b", 4, {}),
    ("1f1b", 8, {}), ("interleaved", 4, {}), ("lpp", 4, {}), ("lpp", 8, {"R": 4}),
    ("fslpp", 4, {}), ("fslpp", 8, {"R": 2}), ("fslpp-seed", 4, {}), ("zb-h1", 4, {}),
    ("zbv", 4, {}), ("1f1b", 4, {"ties": [(0, 3)]}), ("fslpp", 4, {"ties": [(0, 3)]}),
    ("lpp", 4, {"ties": [(0, 3)]}), ("ddp", 4, {"stages": 2, "ties": [(0, 1)]}),
]
IDS = [f"{n}-W{w}-{'-'.join(map(str, kw))}" for n, w, kw in CASES]


def _sizes(result: Plan) -> ModelSizes:
    """Distinct sizes per stage and tie, so that a rank's figures depend on which it holds."""
    stages = tuple(StageSizes(params=100 * (s + 1), grads=100 * (s + 1), optimizer=200 * (s + 1),
                              activations=10 * (s + 2), message=3 * (s + 1),
                              received_activations=11 * (s + 2), inputs=s + 1, loss_graph=1,
                              b_released=2, w_grads=5)
                   for s in range(result.stages))
    ties = {h: TieSizes(tuple(r), 7 * (h + 1), 7 * (h + 1), 14 * (h + 1))
            for h, r in result.ties.items()}
    return ModelSizes(stages, ties)


def _scanned_groups(programs: Programs) -> list[tuple[int, ...]]:
    """The replica groups as the runtime found them before: every program's all-reduces."""
    groups = {tuple(o) for o in programs.owners if len(o) > 1}
    for program in programs.ranks:
        groups.update(tuple(a.group) for a in program
                      if a.op is Op.ALLREDUCE_G and a.group)
    return sorted(groups)


def _messages(programs: Programs, rank: int) -> bool:
    """The executor's decision for ``rank`` (its method, without an executor)."""
    fake: Any = SimpleNamespace(rank=rank, _messages={})
    return ProgramExecutor._has_pytree_messages(fake, programs)


@pytest.mark.parametrize(("name", "W", "kwargs"), CASES, ids=IDS)
def test_rank_local_answers_equal_the_full_path(name: str, W: int, kwargs: dict) -> None:
    result = plan(name, W, **kwargs)
    programs = result.programs
    # replica subgroups: from the owners alone, the same list as scanning every program
    assert owner_groups(programs) == _scanned_groups(programs) == replica_groups(programs)
    # memory: each rank's own prediction and resident bytes are the full path's row
    sizes = _sizes(result)
    every = predict_memory(programs, sizes, result.checkpointed)
    assert [predict_memory(programs, sizes, result.checkpointed, ranks=[r])[0]
            for r in range(W)] == every
    stage_bytes = [s.params for s in sizes.stages]
    tie_bytes = {h: t.params for h, t in sizes.ties.items()}
    assert [resident_bytes(programs, stage_bytes, tie_bytes, ranks=[r])[0]
            for r in range(W)] == resident_bytes(programs, stage_bytes, tie_bytes)
    # the start-up summary from gathered rows is the text read off every program
    rows = [startup_row(result, stage_bytes, tie_bytes, r) for r in range(W)]
    assert (startup_summary(result, stage_bytes, tie_bytes, "cmd", rows)
            == startup_summary(result, stage_bytes, tie_bytes, "cmd"))
    # pytree messages: a rank with any takes the signature, as every rank did before; a rank
    # without any exchanges none, so its peers never depend on its choice
    anywhere = any(a.op in (Op.SEND_ACT, Op.SEND_GRAD) for p in programs.ranks for a in p)
    for rank in range(W):
        mine = _messages(programs, rank)
        p2p = [a for a in programs.ranks[rank]
               if a.op in (Op.SEND_ACT, Op.SEND_GRAD, Op.RECV_ACT, Op.RECV_GRAD)]
        assert mine == bool(p2p)
        if mine:
            assert anywhere
        for a in p2p:  # both ends of every pytree message decide alike
            assert _messages(programs, a.peer)


@pytest.mark.parametrize(("name", "W", "kwargs"), CASES, ids=IDS)
def test_forward_check_rank_local_equals_the_scan(name: str, W: int, kwargs: dict,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    train = plan(name, W, **kwargs).programs
    evaluation = plan(name, W, forward_only=True, **kwargs).programs
    for rank in range(W):
        check_forward_programs(train, evaluation, rank)  # accepted, as by the scan
    monkeypatch.setattr(plan_module, "LAZY_FROM_JOBS", 0)
    lazy_train = plan(name, W, verify=False, **kwargs).programs
    lazy_eval = plan(name, W, forward_only=True, verify=False, **kwargs).programs
    assert isinstance(lazy_eval.ranks, LazyList) and isinstance(lazy_train.ranks, LazyList)
    for rank in range(W):
        check_forward_programs(lazy_train, lazy_eval, rank)
        with pytest.raises(Exception, match="forward-only programs"):
            check_forward_programs(lazy_train, lazy_train, rank)  # a training plan's: refused
    assert lazy_eval.ranks.lowered == W  # each rank its own, one by one


def _made(items: Any) -> int:
    return sum(x is not None for x in items._items)


@pytest.mark.parametrize(("name", "W", "kwargs"), [
    ("1f1b", 8, {}), ("fsdp", 8, {}), ("ddp", 8, {}), ("zbv", 8, {}), ("interleaved", 8, {}),
    ("fslpp", 8, {"ties": [(0, 7)]}), ("lpp", 8, {"R": 4}),
])
def test_a_lazy_plan_start_up_lowers_only_the_own_program(
        name: str, W: int, kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """What one rank's start-up calls on a plan lowered per rank lowers that rank's program
    only, and its answers equal the eager plan's."""
    eager = plan(name, W, verify=False, **kwargs)
    monkeypatch.setattr(plan_module, "LAZY_FROM_JOBS", 0)
    sizes = _sizes(eager)
    stage_bytes = [s.params for s in sizes.stages]
    tie_bytes = {h: t.params for h, t in sizes.ties.items()}
    for rank in (0, W // 2, W - 1):
        lazy = plan(name, W, verify=False, **kwargs)
        evaluation = plan(name, W, forward_only=True, verify=False, **kwargs)
        programs = lazy.programs
        assert isinstance(programs.ranks, LazyList)
        assert replica_groups(programs) == _scanned_groups(eager.programs)
        assert _messages(programs, rank) == _messages(eager.programs, rank)
        check_forward_programs(programs, evaluation.programs, rank)
        assert (predict_memory(programs, sizes, lazy.checkpointed, ranks=[rank])[0]
                == predict_memory(eager.programs, sizes, eager.checkpointed)[rank])
        row = startup_row(lazy, stage_bytes, tie_bytes, rank)
        assert row == startup_row(eager, stage_bytes, tie_bytes, rank)
        assert _made(programs.ranks) == 1, programs.ranks  # its own program, nothing else
        assert _made(evaluation.programs.ranks) == 1
        assert _made(lazy.metrics.per_worker) == 1
