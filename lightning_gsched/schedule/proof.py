"""Deadlock freedom proven once from the timeline; each rank's own checks when it is lowered.

Why: at W=1024 fsdp's programs hold ~10 million actions, too many to lower and dry-run at once,
and ranks by group symmetry (:mod:`.symmetry`) do not run one program up to a renaming (each
serves its own stage to every other rank), so no representative rank's dry run covers the
others. What every rank shares is the rule its actions were placed by; applied to a timeline
that respects the stage graph, it leaves nothing to wait forever.

**The lemma** (the dry run's execution model, :mod:`.dryrun`; only computes and all-reduces
wait). Let no program hold an all-reduce, and let each compute c (simulated start t(c)) consume
only messages (channel, k) whose channel has a k-th send, placed in its sender's program after
no compute that starts at or after t(c). Then every rank runs to its end. Proof: else take,
among the computes the ranks are stuck at, one c of least t(c). The k-th send of a message it
consumes is on a rank q preceded only by computes starting before t(c); q is finished or stuck
at a compute starting no earlier than t(c), so q passed that send and the channel's k-1 sends
before it. All of c's messages are there and c is not stuck: a contradiction.

**All-reduces** (replicated stages) wait for every member. Key one a by T(a), the end of the
compute right before it. If every member's all-reduce of a stage comes right after its last
weight-gradient job of the stage, alone in its gap, and all members end that job at one time
T_s, the argument holds with waits ordered by key (a compute's start, an all-reduce's T): a
member stuck before a is stuck at a compute starting before T(a) or at an earlier all-reduce,
in an earlier gap, of smaller key; a sender stuck before a send at an all-reduce has it in an
earlier gap than the send (within a gap all-reduces follow sends), so its key is at most the
start of a compute before the send, which starts before t(c). Each step lowers the key
strictly: no cycle of waits. Stages with several owners and fetchers are dry-run in full.

**The premise, rank by rank** (:func:`checked_lowering`): for each message (channel, k) a
compute consumes, the k-th send into the rank on that channel comes after sender computes that
start before this one (the last of them does: a worker's starts do not decrease); the rank's
posts on each channel into it carry the messages sent on it, in order; each all-reduce sits
right after the rank's last gradient job of its stage, alone in its gap. Every channel has one
receiver and every wait one rank, so over all ranks these are the lemma's premise and the dry
run's matching check; :func:`.dryrun.check_rank` covers the rest. Trusted: that a rank-local
lowering is the full lowering's for the rank's program and the sends into it (tested at small W).

**Why the check passes** for :mod:`.lower`'s programs of a timeline :func:`certify` accepts (a
guard, not a search): an activation or input gradient is sent right after its producer's
compute, which ends no later than its consumer starts; a run's weights, fetched at the gap before
a compute starting at pt, are served in the owner's gap before its first compute starting at or
after pt, in run order (pt increases along a worker's computes), so the FIFO fix moves no post;
gradients handed to an owner are awaited by no compute; a replicated stage (several owners, none
fetched) is all-reduced right after each owner's last gradient job of it. :func:`certify` checks
the rest on the timeline, in O(jobs) numpy; a timeline it refuses is dry-run in full, and so is
every program for a reader of every rank (:mod:`.lazy_ranks`).
"""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.dryrun import Shared, check_forward_only, check_rank
from lightning_gsched.schedule.jobs import StageGraph, weight_grad_phase
from lightning_gsched.schedule.lower import Lowering, Sends
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import Action, Channel, Message, Op, Programs, check_channel
from lightning_gsched.schedule.simulate import Timeline
from lightning_gsched.schedule.sweep import WorkerOrders

_WAITS = frozenset({Op.F, Op.B, Op.W, Op.ALLREDUCE_G})  # the actions that may wait


def certify(graph: StageGraph, table: PlacementTable, timeline: Timeline,
            ties: Mapping[int, tuple[int, ...]] | None) -> str | None:
    """None where the lemma proves every program of ``lower(graph, table, timeline)`` deadlock-free
    given each rank's own check, else why not. That the orders hold every job once, with each
    rank's check that its computes are its order, is the dry run's coverage check."""
    if ties:
        return "tied weights (their fetches and all-reduces are outside the argument)"
    if not graph.is_chain:
        return "the stage graph is not a chain"
    replicated = [s for s, owners in enumerate(table.owners) if len(owners) > 1]
    if any(len(table.owners[s]) > 1 for s, _ in table.fetch_source):
        return "a stage has several owners and fetchers (all-reduces after gradient receives)"
    start, end = _floats(timeline.start), _floats(timeline.end)
    J = len(start)
    if len(end) != J or not np.all(start < end):
        return "a job's duration is not positive"
    P, B = len(timeline.phases), table.micro
    if P * B * table.stages != J:
        return "the timeline's jobs are not the plan's"
    # flat job (s * B + b) * P + k: slices of step P are one phase, stage-major
    f_start, f_end = start[0::P], end[0::P]
    if not np.all(f_start[B:] >= f_end[:-B]):  # F s b after F s-1 b
        return "a forward starts before its input's forward ends"
    if P >= 2:
        b_start, b_end = start[1::P], end[1::P]
        if not np.all(b_start[-B:] >= f_end[-B:]):  # the last stage's B after its F
            return "a backward starts before its forward ends"
        if not np.all(b_start[:-B] >= b_end[B:]):  # B s b after B s+1 b
            return "a backward starts before its output's backward ends"
    if P == 3 and not np.all(start[2::P] >= b_end):  # W s b after B s b
        return "a weight-gradient job starts before its backward ends"
    if replicated and (why := _replicas_reduce_together(table, timeline, end, replicated)):
        return why
    flat, offsets = _orders(timeline.order)
    if len(flat) != J or np.bincount(flat, minlength=J).max(initial=1) != 1:
        return "the workers' orders do not hold every job once"
    starts = start[flat]
    rising = starts[1:] >= starts[:-1]
    edges = offsets[1:-1]
    rising[edges[(edges > 0) & (edges < len(flat))] - 1] = True  # a worker's last, next's first
    if not np.all(rising):
        return "a worker's starts decrease along its order"
    return None


def _replicas_reduce_together(table: PlacementTable, timeline: Timeline, end: np.ndarray,
                              replicated: list[int]) -> str | None:
    """None where every owner of each replicated stage computes it and ends its last
    weight-gradient job of it at one time T_s (the all-reduce's key in the lemma)."""
    P, B = len(timeline.phases), table.micro
    ends = end[P - 1::P].reshape(table.stages, B)  # weight-gradient jobs: B, or W when split
    for s in replicated:
        last = np.full(table.workers, -np.inf)
        np.maximum.at(last, np.asarray(table.compute[s], dtype=np.int64), ends[s])
        owners = np.asarray(table.owners[s], dtype=np.int64)
        if np.isinf(last[owners]).any():
            return f"an owner of stage {s} does not compute it"
        if not np.all(last[owners] == last[owners[0]]):
            return f"the owners of stage {s} end their last gradient job at different times"
    return None


def _floats(values: Sequence[float]) -> np.ndarray:
    """Times as a float64 array, without a copy of the sweep's ``array('d')``."""
    return np.frombuffer(values, dtype=np.float64) if isinstance(values, array) \
        else np.asarray(values, dtype=np.float64)


def _orders(order: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Every worker's order as one int array and the offsets where each worker's begins."""
    if isinstance(order, WorkerOrders):
        return order.flat, order.offsets
    lengths = np.fromiter(map(len, order), dtype=np.int64, count=len(order))
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    flat = np.fromiter(chain.from_iterable(order), dtype=np.int64, count=int(offsets[-1]))
    return flat, offsets


def checked_lowering(lowering: Lowering, programs_of: Callable[[list[list[Action]]],
                     Programs]) -> Callable[[int], list[Action]]:
    """``rank -> program``: :meth:`Lowering.program`, checked as the module docstring says
    (``programs_of`` wraps a list of programs with the plan's facts)."""
    timeline = lowering.timeline
    W, P, B = len(timeline.order), len(timeline.phases), lowering.table.micro
    phase = {op: k for k, op in enumerate((Op.F, Op.B, Op.W)[:P])}
    grad_op = Op(weight_grad_phase(P == 3).value)  # the job that ends a backward

    def make(rank: int) -> list[Action]:
        program, sends = lowering.program_and_sends(rank)
        programs = programs_of([[]] * rank + [program] + [[]] * (W - 1 - rank))
        if programs.forward_only:
            check_forward_only(rank, program)
        # its computes are its order (then every job runs once: certify's coverage check)
        computes = [-1 if a[2] is None else (a[1] * B + a[2]) * P + phase[a[0]]
                    for a in program if a[0] in phase]
        if computes != timeline.order[rank]:
            raise ProgramError(f"rank {rank}'s computes are not its timeline order")
        shared = Shared(programs)
        events = check_rank(shared, rank).events
        sent = _check_channels_into(W, shared, sends)
        # the lemma's premise for this rank's waits (module docstring)
        start, order = timeline.start, timeline.order
        for event in events:
            if event.__class__ is int:
                continue
            index, consumed = event[0], event[1]
            action = program[index]
            if len(event) == 4:
                _check_allreduce(rank, program, index, consumed, grad_op)
                continue
            t = start[(action[1] * B + action[2]) * P + phase[action[0]]]
            for channel, k in consumed:
                src, gap = sent[channel][k - 1]
                jobs = order[src]
                gap = min(gap, len(jobs))  # the sender's computes before the send: jobs[:gap]
                if gap and not start[jobs[gap - 1]] < t:
                    raise ProgramError(
                        f"rank {rank} at action {index} ('{action}'): message {k} of its "
                        f"channel from rank {src} is sent after a compute that starts no "
                        "earlier than this one (the deadlock argument, proof.py, fails)")
        return program

    return make


def _check_allreduce(rank: int, program: list[Action], index: int, consumed: list[Any],
                     grad_op: Op) -> None:
    """The lemma's premise for an all-reduce: it waits for no gradient message, and the last
    compute or all-reduce before it is this rank's last gradient job of its stage."""
    action = program[index]
    stage = action[1]
    before = next((program[i] for i in range(index - 1, -1, -1) if program[i][0] in _WAITS), None)
    if consumed or before is None or before[0] is not grad_op or before[1] != stage or any(
            a[0] is grad_op and a[1] == stage for a in program[index + 1:]):
        raise ProgramError(f"rank {rank} at action {index} ('{action}'): an all-reduce not "
                           "right after this rank's last gradient job of its stage is outside "
                           "the argument (proof.py)")


def _check_channels_into(W: int, shared: Shared, sends: Sends) -> dict[int, list[tuple[int, int]]]:
    """:func:`.program.check_channel` of every channel into the rank; returns per channel
    number each send's (sender, gap in the sender's program)."""
    where: dict[int, list[tuple[int, int]]] = {}
    channels = {channel.number(W): channel for channel in sends if sends[channel]}
    channels.update((number, Channel.numbered(number, W)) for number in shared.posted)
    for number, channel in channels.items():
        messages = sends.get(channel, [])
        check_channel(channel, [message for message, _ in messages],
                      [Message.of(action) for action in shared.posted.get(number, ())])
        if messages:
            where[number] = [(channel.src, gap) for _, gap in messages]
    return where
