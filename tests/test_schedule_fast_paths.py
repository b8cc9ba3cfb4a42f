"""The planner's fast paths against straightforward references kept here.

The planner's hot loops (priority ranks, lowering's data flow, FIFO posting and flattening, the
op counts, the dry run's coverage) were rewritten for speed (issue 14: W=64, S=64, B=256 in
well under a second). Each is compared here, on small sizes, with the plain algorithm it
replaced: the programs must come out identical action for action, not merely equivalent.
"""

from __future__ import annotations

from collections import defaultdict
from importlib import import_module

import pytest

from lightning_gsched.errors import ProgramError, ScheduleConfigError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.jobs import Phase, StageGraph, all_jobs
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.orders import (
    bfs,
    gpipe,
    interleaved_order,
    one_f_one_b,
    zero_bubble,
)
from lightning_gsched.schedule.program import (
    CHANNEL_OF,
    OPS,
    RECV_FOR_SEND,
    RECV_OPS,
    SEND_OPS,
    Action,
    Op,
    Programs,
)
from lightning_gsched.schedule.simulate import priority_ranks

lower_module = import_module("lightning_gsched.schedule.lower")
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


# ---------------------------------------------------------------- lowering


def reference_lower(graph, table, timeline, fetch_window):
    """Lowering as it was written before the fast paths: a Job-keyed index, every message put
    through ``put``, FIFO posting by classifying every action, and one sort of all actions."""
    build = lower_module._Builder(timeline)
    index = {slot.job: i for slots in timeline.by_worker for i, slot in enumerate(slots)}
    kinds = {Phase.F: (Op.SEND_ACT, Op.RECV_ACT), Phase.B: (Op.SEND_GRAD, Op.RECV_GRAD)}
    done = set()
    for worker, slots in enumerate(timeline.by_worker):
        for i, slot in enumerate(slots):
            s, b, phase = slot.job
            sources = (graph.inputs(s) if phase is Phase.F
                       else graph.outputs(s) if phase is Phase.B else [])
            for other in sources:
                src = table.compute[other][b]
                if src == worker or (other, b, phase, worker) in done:
                    continue
                done.add((other, b, phase, worker))
                produced = index[(other, b, phase)]
                send, recv = kinds[phase]
                build.put(src, produced + 1, timeline.by_worker[src][produced].end,
                          Action(send, other, b, worker))
                build.put(worker, max(i - 1, 0), slot.start, Action(recv, other, b, src))
    grad_phase = Phase.W if graph.split_backward else Phase.B
    reduce_gaps = lower_module._lower_weights(table, timeline, build, grad_phase, fetch_window)
    if not graph.forward_only:
        lower_module._lower_allreduce(table, timeline, build, reduce_gaps, grad_phase)
    _reference_make_fifo(build.entries)
    programs = []
    for rank, entries in enumerate(build.entries):
        keyed = [((i, 99), Action(Op(slot.job.phase.value), slot.job.stage, slot.job.micro))
                 for i, slot in enumerate(timeline.by_worker[rank])]
        programs.append([action for _, action in sorted(keyed + entries, key=lambda e: e[0])])
    return programs


def _reference_make_fifo(all_entries):
    sends = defaultdict(list)
    recvs = defaultdict(lambda: defaultdict(list))
    for rank, entries in enumerate(all_entries):
        for index, (key, action) in enumerate(entries):
            if action.op in SEND_OPS:
                ident = (action.stage, action.micro, RECV_FOR_SEND[action.op])
                sends[(CHANNEL_OF[action.op], rank, action.peer)].append((key, ident))
            elif action.op in RECV_OPS:
                ident = (action.stage, action.micro, action.op)
                recvs[(CHANNEL_OF[action.op], action.peer, rank)][ident].append((key, index))
    for (channel, src, dst), sent in sends.items():
        sent.sort()
        waiting = recvs[(channel, src, dst)]
        for queue in waiting.values():
            queue.sort(reverse=True)
        matched = [waiting[ident].pop()[1] if waiting[ident] else None for _, ident in sent]
        running = None
        for position in reversed(range(len(matched))):
            if matched[position] is None:
                continue
            key, recv = all_entries[dst][matched[position]]
            key = key[:4] if running is None or key[:4] <= running else running
            running = key
            all_entries[dst][matched[position]] = ((*key, position), recv)


def _cases():
    for name in LIBRARY:
        S = 8 if name in ("zbv", "interleaved", "lpp") else 4
        for kwargs in ({}, {"forward_only": True}, {"fetch_window": 1},
                       {"forward_cost": [1.0, 1.5, 0.5, 1.0] * (S // 4),
                        "backward_cost": [2.0, 1.0, 3.0, 2.5] * (S // 4)}):
            yield pytest.param(name, S, kwargs, id=f"{name}-{'-'.join(kwargs) or 'plain'}")


@pytest.mark.parametrize("name,S,kwargs", list(_cases()))
def test_lowering_matches_the_reference(name, S, kwargs):
    result = plan(name, workers=4, stages=S, microbatches=8, verify=False, **kwargs)
    graph = StageGraph(S, forward_only=result.forward_only,
                       split_backward=result.programs.split_backward)
    expected = reference_lower(graph, result.table, result.timeline, result.fetch_window)
    assert result.programs.ranks == expected


@pytest.mark.parametrize("split", [False, True])
def test_lowering_of_a_dag_matches_the_reference(split):
    edges = [(0, 2), (1, 2), (0, 3), (2, 3)]  # one output feeding two stages, two inputs
    result = plan(None, workers=3, stages=4, microbatches=6, edges=edges, split_backward=split,
                  placement=lambda s, b, d: (s % 3, (s + b) % 3), verify=False)
    graph = StageGraph(4, edges, split_backward=split)
    assert result.programs.ranks == reference_lower(graph, result.table, result.timeline, None)


def test_posts_are_moved_when_a_channel_is_out_of_order():
    """The FIFO pass's slow path (posts not already in send order) against the reference."""
    timeline_owner = plan("1f1b", workers=2, stages=2, microbatches=4, verify=False)
    build = lower_module._Builder(timeline_owner.timeline)
    # two sends on one channel in one order, their posts in the other
    build.put(0, 1, 1.0, Action(Op.SEND_ACT, 0, 0, 1))
    build.put(0, 2, 2.0, Action(Op.SEND_ACT, 0, 1, 1))
    build.put(1, 3, 0.5, Action(Op.RECV_ACT, 0, 1, 0))
    build.put(1, 4, 0.7, Action(Op.RECV_ACT, 0, 0, 0))
    reference = [list(entries) for entries in build.entries]
    _reference_make_fifo(reference)
    build.make_fifo()
    assert build.entries == reference
    assert build.entries[1][1][0][:4] == build.entries[1][0][0][:4]  # moved earlier


# ---------------------------------------------------------------- counts and coverage


def reference_counts(programs, rank):
    counts = {OPS[op].counter: 0 for op in Op if OPS[op].counter}
    stash = peak_stash = 0
    resident = peak_resident = owned = len(programs.owned_stages(rank))
    for action in programs.ranks[rank]:
        if OPS[action.op].counter:
            counts[OPS[action.op].counter] += 1
        if programs.releases_stash is not None and action.op is Op.F:
            stash += 1
            peak_stash = max(peak_stash, stash)
        elif action.op is programs.releases_stash:
            stash -= 1
        elif action.op is Op.FETCH_W:
            resident += 1
            peak_resident = max(peak_resident, resident)
        elif action.op is Op.FREE_W:
            resident -= 1
    return {**counts, "peak_activations": peak_stash, "owned_stages": owned,
            "peak_resident_stages": peak_resident}


@pytest.mark.parametrize("name", ["fsdp", "lpp", "fslpp", "zb-h1", "zbv"])
@pytest.mark.parametrize("forward_only", [False, True])
def test_program_counts_match_a_plain_count(name, forward_only):
    S = 8 if name in ("zbv", "lpp") else 4
    result = plan(name, workers=4, stages=S, microbatches=8, forward_only=forward_only)
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
