"""The planner's fast paths against the plain algorithms they replaced.

The planner's hot loops (priority ranks, the placement table, the simulation, the lowering's
data flow and FIFO posting, the op counts, the dry run) were rewritten for speed (issue 14:
W=64, S=64, B=256 in well under a second). Each is compared here, on small sizes, with a plain
reference (:mod:`planner_references`, or a few lines here): timelines and programs must come
out identical slot for slot and action for action, the dry run must accept and reject the same
programs.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from importlib import import_module

import pytest

import planner_references
from lightning_gsched.errors import CapTooSmallError, ProgramError, ScheduleConfigError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.dryrun import dry_run
from lightning_gsched.schedule.jobs import StageGraph, all_jobs
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.lower_build import Builder
from lightning_gsched.schedule.orders import (
    bfs,
    gpipe,
    interleaved_order,
    one_f_one_b,
    resolve_order,
    zero_bubble,
)
from lightning_gsched.schedule.placements import (
    DDP,
    FSDP,
    FSLPP,
    LPP,
    FSLPPSeed,
    GPipe,
    PlacementTable,
    VShape,
)
from lightning_gsched.schedule.priorities import priority_ranks
from lightning_gsched.schedule.program import OPS, Action, Op, Programs
from planner_references import (
    reference_dry_run,
    reference_lower,
    reference_make_fifo,
    reference_simulate,
)

simulate_module = import_module("lightning_gsched.schedule.simulate")
metrics_module = import_module("lightning_gsched.schedule.metrics")


# ---------------------------------------------------------------- priority ranks


def reference_ranks(priority, S, B, forward_only=False, split=False):
    """Sort (n(job), job) pairs; rank per flat index (stage * B + micro) * P + phase."""
    jobs = list(all_jobs(S, B, forward_only, split))
    order = sorted(range(len(jobs)), key=lambda i: (priority(*jobs[i]), jobs[i]))
    ranks = [0] * len(jobs)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


@pytest.mark.parametrize("priority", [
    bfs, gpipe, one_f_one_b, zero_bubble,
    lambda s, b, d: (b % 3, -s),  # ties between phases and microbatches: the job decides
    lambda s, b, d: 0.5 * b - s,  # floats: not packed
    lambda s, b, d: (b % 2 == 0, s),  # bools: not packed
    lambda s, b, d: (b, (s, -s)),  # nested tuples: not packed
    lambda s, b, d: 7,  # one value for all: job order alone
], ids=["bfs", "gpipe", "1f1b", "zb", "ties", "floats", "bools", "nested", "constant"])
@pytest.mark.parametrize("forward_only,split", [(False, False), (True, False), (False, True)])
def test_priority_ranks_order_as_the_sorted_pairs(priority, forward_only, split):
    for S, B in ((1, 1), (3, 5), (6, 4)):
        assert (priority_ranks(priority, S, B, forward_only, split)
                == reference_ranks(priority, S, B, forward_only, split))


def test_priority_ranks_of_the_interleaved_order():
    W, S, B, R = 4, 8, 8, 4
    order = interleaved_order(W, S, B, R)  # int positions, equal across workers
    assert priority_ranks(order, S, B) == reference_ranks(order, S, B)


def test_priority_ranks_still_refuse_incomparable_values():
    with pytest.raises(ScheduleConfigError, match="mutually comparable"):
        priority_ranks(lambda s, b, d: (s, b) if b else "x", 2, 2)


# ---------------------------------------------------------------- simulation


def _timeline_cases():
    for name in LIBRARY:
        S = 8 if name in ("zbv", "v-half", "v-min", "interleaved", "lpp") else 4
        for kwargs in ({}, {"forward_only": True}, {"cap": None}, {"cap": "auto"},
                       {"forward_cost": [1.0, 1.5, 0.5, 1.0] * (S // 4),
                        "backward_cost": [2.0, 1.0, 3.0, 2.5] * (S // 4)}):
            yield pytest.param(name, S, kwargs, id=f"{name}-{'-'.join(kwargs) or 'plain'}")


def _reference_timeline(result, graph, order=None):
    spec = LIBRARY.get(result.schedule)
    priority = resolve_order(order or spec.order, result.workers, result.stages, result.micro,
                             result.R)
    ranks = priority_ranks(priority, result.stages, result.micro, graph.forward_only,
                           graph.split_backward)
    return reference_simulate(graph, result.table, ranks, result.costs, result.caps)


@pytest.mark.parametrize("name,S,kwargs", list(_timeline_cases()))
def test_simulation_matches_the_plain_greedy_rule(name, S, kwargs):
    result = plan(name, workers=4, stages=S, microbatches=8, verify=False, **kwargs)
    graph = StageGraph(S, forward_only=result.forward_only,
                       split_backward=result.programs.split_backward)
    expected = _reference_timeline(result, graph)
    assert result.timeline.slots == expected
    assert result.timeline.by_worker == [[x for x in expected if x.worker == w]
                                         for w in range(4)]
    assert result.metrics.latency == max(x.end for x in expected)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1", "zbv", "v-half", "fslpp",
                                  "interleaved"])
@pytest.mark.parametrize("cap", [1, 2, 3, 5])
def test_capped_simulation_completes_or_sticks_as_the_plain_rule_does(name, cap):
    """Small uniform caps: the same timeline as the reference, or both stuck."""
    S = 8 if name in ("zbv", "v-half", "interleaved") else 4
    result = plan(name, workers=4, stages=S, microbatches=8, verify=False, cap=None)
    graph = StageGraph(S, split_backward=result.programs.split_backward)
    spec = LIBRARY[name]
    ranks = priority_ranks(resolve_order(spec.order, 4, S, 8, result.R), S, 8, False,
                           graph.split_backward)
    caps = [cap] * 4
    try:
        expected = reference_simulate(graph, result.table, ranks, result.costs, caps)
    except CapTooSmallError:
        with pytest.raises(CapTooSmallError, match="cannot make progress"):
            simulate_module.simulate(graph, result.table, ranks, result.costs, caps)
        return
    assert simulate_module.simulate(graph, result.table, ranks, result.costs, caps).slots == expected


@pytest.mark.parametrize("split", [False, True])
def test_simulation_of_a_dag_matches_the_plain_greedy_rule(split):
    edges = [(0, 2), (1, 2), (0, 3), (2, 3)]  # two inputs to one stage: counted readiness
    result = planner_references.plan_general_graph(
        edges, workers=3, stages=4, microbatches=6, split_backward=split,
        placement=lambda s, b, d: (s % 3, (s + b) % 3), order="1f1b")
    graph = StageGraph(4, edges, split_backward=split)
    assert result.timeline.slots == _reference_timeline(result, graph, order="1f1b")


# ---------------------------------------------------------------- placement rows


@pytest.mark.parametrize("placement,S,B", [
    (DDP(4), 3, 8), (FSDP(4), 8, 8), (GPipe(4, 8), 8, 6), (VShape(2, 8), 8, 4),
    (LPP(6, 3), 6, 4), (LPP(4, 1), 4, 4), (FSLPP(6, 2), 8, 6), (FSLPP(4, 4), 8, 4),
    (FSLPPSeed(6, 3), 9, 4),
    # rows repeating with the groups' period (micro_period), over several periods
    (LPP(4, 2), 4, 12), (LPP(4, 4), 8, 8), (FSDP(3), 3, 9), (FSLPP(4, 2), 4, 10),
    (FSLPPSeed(4, 2), 4, 6), (DDP(2), 1, 6),
])
def test_library_placement_rows_match_calling_the_placement(placement, S, B):
    """A library placement's ``rows`` (its ``__call__`` evaluated once per distinct row entry,
    from the symmetry the class states) give the table that calling it per job gives: the
    symmetry claims (``weights_key``, ``compute_key``, rows constant or periodic in the
    microbatch) hold."""
    fast = PlacementTable(placement, placement.workers, S, B)
    called = PlacementTable(lambda s, b, d: placement(s, b, d), placement.workers, S, B)
    assert fast.compute == called.compute and fast.weights == called.weights
    assert fast.owners == called.owners and fast.fetch_source == called.fetch_source


# ---------------------------------------------------------------- lowering


def _lowering_cases():
    for name in LIBRARY:
        S = 8 if name in ("zbv", "v-half", "v-min", "interleaved", "lpp") else 4
        for kwargs in ({}, {"forward_only": True}, {"fetch_window": 1},
                       {"ties": {0: (0, S - 1)}}, {"ties": {1: (1, 2)}, "forward_only": True},
                       {"forward_cost": [1.0, 1.5, 0.5, 1.0] * (S // 4),
                        "backward_cost": [2.0, 1.0, 3.0, 2.5] * (S // 4)}):
            yield pytest.param(name, S, kwargs, id=f"{name}-{'-'.join(kwargs) or 'plain'}")


@pytest.mark.parametrize("name,S,kwargs", list(_lowering_cases()))
def test_lowering_matches_the_reference(name, S, kwargs):
    result = plan(name, workers=4, stages=S, microbatches=8, verify=False, **kwargs)
    graph = StageGraph(S, forward_only=result.forward_only,
                       split_backward=result.programs.split_backward)
    expected = reference_lower(graph, result.table, result.timeline, result.fetch_window,
                               result.ties)
    assert result.programs.ranks == expected


@pytest.mark.parametrize("split", [False, True])
def test_lowering_of_a_dag_matches_the_reference(split):
    edges = [(0, 2), (1, 2), (0, 3), (2, 3)]  # one output feeding two stages, two inputs
    result = planner_references.plan_general_graph(
        edges, workers=3, stages=4, microbatches=6, split_backward=split,
        placement=lambda s, b, d: (s % 3, (s + b) % 3))
    graph = StageGraph(4, edges, split_backward=split)
    assert result.programs.ranks == reference_lower(graph, result.table, result.timeline)


@pytest.mark.parametrize("W,S,B", [(2, 4, 4), (4, 8, 8), (3, 6, 6), (4, 16, 8)])
def test_zbv_posts_moved_for_fifo_order_match_the_reference(W, S, B):
    """zbv's channels carry activations one way and gradients the other, whose posts are not in
    send order: the data flow's own FIFO fix must move the same posts as the reference."""
    result = plan("zbv", workers=W, stages=S, microbatches=B, verify=False)
    graph = StageGraph(S, split_backward=True)
    build = planner_references._Keyed(result.timeline.by_worker)
    planner_references._reference_data_flow(graph, result.table, result.timeline.by_worker,
                                             build)
    assert planner_references.reference_make_fifo(build.entries) > 0  # the slow path runs
    assert result.programs.ranks == reference_lower(graph, result.table, result.timeline)


def test_posts_are_moved_when_a_channel_is_out_of_order():
    """The FIFO pass of the keyed actions (weights, gradients, ties: ``Builder.put``) when
    posts are not already in send order, against the reference."""
    timeline_owner = plan("1f1b", workers=2, stages=2, microbatches=4, verify=False)
    build = Builder(timeline_owner.timeline)
    # two sends on one channel in one order, their posts in the other
    build.put(0, 1, 1.0, Action(Op.SEND_W, 0, None, 1))
    build.put(0, 2, 2.0, Action(Op.SEND_W, 1, None, 1))
    build.put(1, 3, 0.5, Action(Op.FETCH_W, 1, None, 0))
    build.put(1, 4, 0.7, Action(Op.FETCH_W, 0, None, 0))
    reference = [list(entries) for entries in build.entries]
    assert reference_make_fifo(reference) == 1
    build.make_fifo()
    assert build.entries == reference
    assert build.entries[1][1][0][:4] == build.entries[1][0][0][:4]  # moved earlier


# ---------------------------------------------------------------- counts and coverage


def reference_counts(programs, rank):
    counts = {name: 0 for op in Op for name in (OPS[op].counter, OPS[op].tie_counter) if name}
    stash = peak_stash = 0
    resident = peak_resident = owned = len(programs.owned_stages(rank))
    for action in programs.ranks[rank]:
        name = OPS[action.op].tie_counter if action.tie else OPS[action.op].counter
        if name:
            counts[name] += 1
        if programs.weight_grad_op is not None and action.op is Op.F:
            stash += 1
            peak_stash = max(peak_stash, stash)
        elif action.op is programs.weight_grad_op:
            stash -= 1
        elif action.op is Op.FETCH_W and not action.tie:  # a tie is no stage
            resident += 1
            peak_resident = max(peak_resident, resident)
        elif action.op is Op.FREE_W and not action.tie:
            resident -= 1
    return {**counts, "peak_activations": peak_stash, "owned_stages": owned,
            "peak_resident_stages": peak_resident}


@pytest.mark.parametrize("name", ["fsdp", "lpp", "fslpp", "zb-h1", "zbv"])
@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_program_counts_match_a_plain_count(name, forward_only, tied):
    S = 8 if name in ("zbv", "lpp") else 4
    result = plan(name, workers=4, stages=S, microbatches=8, forward_only=forward_only,
                  ties=[(0, S - 1)] if tied else None)
    for rank in range(4):
        assert (metrics_module.program_counts(result.programs, rank).planned()
                == reference_counts(result.programs, rank))


def _replicated(ranks_actions, micro=1):
    return Programs([[Action.parse(a) for a in actions] for actions in ranks_actions],
                    num_stages=1, num_micro=micro, owners=[(0, 1)], edges=[],
                    forward_only=True)


def test_dry_run_coverage_names_a_job_run_twice_or_never():
    dry_run = import_module("lightning_gsched.schedule.dryrun").dry_run
    dry_run(_replicated([["F s0 b0"], ["F s0 b1"]], micro=2))  # each once: fine
    with pytest.raises(ProgramError, match="job F s0 b0 runs 2 times across ranks"):
        dry_run(_replicated([["F s0 b0"], ["F s0 b0"]]))
    with pytest.raises(ProgramError, match="job F s0 b1 runs 0 times across ranks"):
        dry_run(_replicated([["F s0 b0"], []], micro=2))
    # as many runs as jobs, but one job twice and one never
    with pytest.raises(ProgramError, match="job F s0 b0 runs 2 times"):
        dry_run(_replicated([["F s0 b0"], ["F s0 b0"]], micro=2))


# ---------------------------------------------------------------- dry run


def _mutations(programs, rng, count):
    """``count`` copies of ``programs``, each with one or two actions dropped, duplicated or
    moved: most break a rule, some stay valid (the dry run must tell which)."""
    for _ in range(count):
        ranks = [list(program) for program in programs.ranks]
        for _ in range(rng.choice((1, 1, 2))):
            program = ranks[rng.randrange(len(ranks))]
            i = rng.randrange(len(program))
            kind = rng.choice(("drop", "duplicate", "move", "swap"))
            if kind == "drop":
                program.pop(i)
            elif kind == "duplicate":
                program.insert(rng.randrange(len(program) + 1), program[i])
            elif kind == "move":
                program.insert(rng.randrange(len(program)), program.pop(i))
            else:
                j = min(i + 1, len(program) - 1)
                program[i], program[j] = program[j], program[i]
        yield dataclasses.replace(programs, ranks=ranks)


def _verdict(check, programs):
    try:
        check(programs)
    except ProgramError:
        return "rejected"
    return "runs"


@pytest.mark.parametrize("name,kwargs", [
    ("gpipe", {"workers": 2, "microbatches": 3}), ("fsdp", {"workers": 3}),
    ("1f1b", {"workers": 3, "microbatches": 6}), ("zbv", {"workers": 2, "stages": 4}),
    ("lpp", {"workers": 4, "stages": 4, "microbatches": 8}),
    ("fslpp", {"workers": 4, "stages": 8, "microbatches": 8, "ties": {0: (0, 7)}}),
    ("zb-h1", {"workers": 3, "microbatches": 6, "ties": [[0, 2]]}),
    ("fsdp", {"workers": 2, "forward_only": True, "ties": {0: (0, 1)}}),
])
def test_dry_run_accepts_and_rejects_what_the_plain_walk_does(name, kwargs):
    """The dry run (each rank checked once, then a walk of sends and waits) against the plain
    one-action-at-a-time reference: the same verdict on the plan and on 60 mutations of it."""
    programs = plan(name, verify=False, **kwargs).programs
    reference_dry_run(programs)
    dry_run(programs)
    verdicts = Counter()
    for broken in _mutations(programs, random.Random(f"{name}{sorted(kwargs)}"), 60):
        verdict = _verdict(reference_dry_run, broken)
        assert _verdict(dry_run, broken) == verdict
        verdicts[verdict] += 1
    assert verdicts["rejected"] > 0


@pytest.mark.parametrize("bad,message", [
    (Action(Op.SEND_ACT, 0, 0, 7), "its peer must be a rank"),
    (Action(Op.RECV_ACT, 0, None, 1), "its microbatch one of 0 to 1"),
    (Action(Op.F, 0, 9), "names microbatch 9"),
    (Action(Op.FETCH_W, 1, None, None), "its peer must be a rank"),
    (Action(Op.ALLREDUCE_G, 0, None, None, (1,)), "is not in its group"),
])
def test_dry_run_names_an_action_whose_ints_do_not_exist(bad, message):
    """Jobs and channels are ints in the dry run: a peer, microbatch or group that is not one of
    the programs' is named, not turned into another job or channel."""
    programs = plan("gpipe", workers=2, microbatches=2).programs
    ranks = [list(program) for program in programs.ranks]
    ranks[0].insert(1, bad)
    broken = dataclasses.replace(programs, ranks=ranks)
    with pytest.raises(ProgramError, match=message):
        dry_run(broken)
    with pytest.raises(ProgramError):
        reference_dry_run(broken)
