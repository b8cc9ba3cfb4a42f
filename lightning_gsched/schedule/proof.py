"""Deadlock freedom proven once from the timeline; each rank's own checks when it is lowered.

Why: at W=1024 fsdp's programs hold ~10 million actions; lowering and dry-running them all
took 70 s and 5.4 GB, while the ranks of a plan whose timeline comes by group symmetry
(:mod:`.symmetry`) do *not* run one program up to a renaming (each owns a different stage,
which it serves to every other rank), so no representative rank's dry run covers the others.
What every rank does share is the rule its actions were placed by, and that rule, applied to a
timeline that respects the stage graph, leaves nothing to wait forever. So the proof is done
once, on the timeline, and each rank checks what only its own program decides.

**The lemma** (the dry run's execution model, :mod:`.dryrun`: sends never block; a compute
waits for the messages it consumes, the k-th message of a channel being there once the channel
counted k sends; only computes and all-reduces wait). Let every program be free of all-reduces
and let each compute c (simulated start t(c)) consume only messages (channel, k) whose channel
has a k-th send, placed in its sender's program after no compute that starts at or after t(c).
Then every rank runs to its end. Proof: else take, among the computes the ranks are stuck at,
one c of least t(c). A message (ch, k) it consumes has its k-th send on a rank q preceded only
by computes starting before t(c); q is finished or stuck at a compute starting no earlier than
t(c), so q passed that send, and the first k-1 sends of ch, which precede it in q's program.
All of c's messages are there and c is not stuck: a contradiction.

**All-reduces** (replicated stages: each replica of a data-parallel lift owns its copy,
:mod:`.data_parallel`). An all-reduce waits for every member of its group. Give it the key
T(a): the end of the compute right before it. If every member's all-reduce of a stage comes
right after that member's last weight-gradient job of the stage, alone in its gap, and every
member ends that job at one time T_s (:func:`certify` checks the timeline: the replicas run
the same timeline renamed), the argument above holds with waits ordered by key (a compute's
start, an all-reduce's T): a member stuck before an all-reduce a is stuck at a compute that
starts before T(a) (it ends no later) or at an earlier all-reduce, which sits in an earlier
gap and so has a smaller key; a sender stuck before a send at an all-reduce has it in an
earlier gap than the send (within a gap the all-reduce's category follows every send's), so
its key is at most the start of a compute before the send, which starts before t(c). Each
step lowers the key strictly: no cycle of waits exists. Stages with several owners and
fetchers (their all-reduce waits for gradient receives) are dry-run in full.

**The premise is checked, rank by rank** (:func:`checked_lowering`, when a rank's program is
first lowered): for each compute of the rank and each message (channel, k) it consumes (the
dry run's own per-rank check, :func:`.dryrun_rank.check_rank`, names them), the k-th send into
the rank on that channel (the rank-local lowering makes every send into the rank and knows its
gap in the sender's program: :func:`.lower.sends_into`) must come after sender computes
that start before this one (the last of them does: a worker's starts do not decrease); the rank's posts on every channel into it must carry the messages
sent on it, in order (so the channel has its k-th send); and each all-reduce must sit right
after the rank's last gradient job of its stage, alone in its gap. Every
channel has one receiver and every wait one rank, so these checks over all ranks are exactly
the lemma's premise and the dry run's matching check: the plan is deadlock-free once every
rank that runs has passed its own check, which it does before its program is returned (a
failure raises :class:`ProgramError` there). The same per-rank check covers the rest of the
dry run (weights, inputs, stash, gradients, the state at the end, forward-only ops). What the
checks trust: that a rank-local lowering is the full lowering's, for the rank's own program
and the sends into it (:mod:`.lower`; tests compare every rank's program at small W), so
the sends rank r checks against are those its peers' programs hold.

**Why the check always passes** for :mod:`.lower`'s programs of a timeline :func:`certify`
accepts (so it is a guard, not a search; ``tests/test_schedule_proof.py`` also checks the
premise on fully lowered programs):

- an activation (input gradient) consumed by F s b (B s b) is the producer job's output, sent
  by ``SEND_ACT`` (``SEND_GRAD``) right after the producer's compute (the first category of the
  next gap); the computes before it start no later than the producer, which starts before it
  ends (durations are positive), which is no later than t(c) (the timeline respects the graph);
- a fetched stage's weights consumed by a compute of a run fetched at the gap before a compute
  starting at pt (0.0 for a run fetched before the first compute; pt <= the run's starts, as a
  worker's starts do not decrease) are ``SEND_W`` put in the owner's program in the gap before
  its first compute starting at or after pt (``gap_at``, a bisection of the owner's starts):
  after computes starting before pt only. A rank's fetches of one owner's stages, and the
  owner's sends of them to it, are both in the order of the runs (pt strictly increases along
  a worker's computes, equal only for two runs fetched before the first one, ordered by
  creation), so the FIFO fix moves no post and the run's computes consume the run's own send;
- gradients handed to the owner (``REDUCE_G``/``RECV_G``) are waited for by no compute; a
  replicated stage (several owners, none fetched) has its all-reduce put right after each
  owner's last gradient job of it (:func:`.lower.lower`), and no two stages of a rank end at
  one job; there are no ties.

What :func:`certify` checks on the timeline (O(jobs), in numpy; the planner asks it
for timelines by group symmetry and for plans of :data:`.plan.LAZY_FROM_JOBS` jobs or more, the
pipelines at large W, and dry-runs anything else in full): a chain graph, no ties, no stage
both replicated and fetched, every owner of a replicated stage computing it and ending its last
gradient job of it at one time; every
job's duration is positive; every job starts no earlier than its predecessors end; every
worker's starts do not decrease along its order; the workers' orders hold every job exactly
once (each rank checks that its computes are its order, so every job runs once: the dry
run's coverage check). A timeline whose renaming is broken fails one of these and
is dry-run in full. A reader of every program (the CLI's table, ``--json``, the runtime's
channel set-up) takes the full path at once (:mod:`.lazy_ranks`): every program lowered and
dry-run.
"""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lightning_gsched.errors import ProgramError
from lightning_gsched.schedule.dryrun_rank import Shared, check_rank
from lightning_gsched.schedule.jobs import StageGraph, weight_grad_phase
from lightning_gsched.schedule.lower import Lowering
from lightning_gsched.schedule.placements import PlacementTable
from lightning_gsched.schedule.program import (
    BACKWARD_OPS,
    Action,
    Channel,
    Message,
    Op,
    Programs,
    check_channel,
)
from lightning_gsched.schedule.simulate import Timeline
from lightning_gsched.schedule.sweep import WorkerOrders


def certify(graph: StageGraph, table: PlacementTable, timeline: Timeline,
            ties: Mapping[int, tuple[int, ...]] | None) -> str | None:
    """None where the lemma (module docstring) proves every program of ``lower(graph, table,
    timeline)`` deadlock-free given each rank's own check; else why not (then the caller
    dry-runs every program)."""
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
    if replicated:
        why = _replicas_reduce_together(table, timeline, end, replicated)
        if why is not None:
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
    weight-gradient job of it at the same time T_s (the all-reduce's key in the lemma: each
    replica of a data-parallel lift runs the same timeline, renamed)."""
    P, B = len(timeline.phases), table.micro
    grad = P - 1  # the job that accumulates weight gradients: B, or W when split
    ends = end[grad::P].reshape(table.stages, B)
    for s in replicated:
        workers = np.asarray(table.compute[s], dtype=np.int64)
        last = np.full(table.workers, -np.inf)
        np.maximum.at(last, workers, ends[s])
        owners = np.asarray(table.owners[s], dtype=np.int64)
        if np.isinf(last[owners]).any():
            return f"an owner of stage {s} does not compute it"
        if not np.all(last[owners] == last[owners[0]]):
            return f"the owners of stage {s} end their last gradient job at different times"
    return None


def _floats(values: Sequence[float]) -> np.ndarray:
    """Times as a float64 array: without a copy for the sweep's ``array('d')``."""
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
    before it is returned (``programs_of`` wraps a list of programs with the plan's facts)."""
    timeline = lowering.timeline
    W = len(timeline.order)
    P, B = len(timeline.phases), lowering.table.micro
    phase = {op: k for k, op in enumerate((Op.F, Op.B, Op.W)[:P])}
    grad_op = Op(weight_grad_phase(P == 3).value)  # the job that ends a backward
    empty: list[Action] = []

    def make(rank: int) -> list[Action]:
        program, sends = lowering.program_and_sends(rank)
        ranks = [empty] * W
        ranks[rank] = program
        programs = programs_of(ranks)
        if programs.forward_only:
            for index, action in enumerate(program):
                if action.op in BACKWARD_OPS:
                    raise ProgramError(f"rank {rank} at action {index} ('{action}'): "
                                       "forward-only programs contain no backward action")
        # its computes are its order (then every job runs once: certify's coverage check)
        computes = [-1 if a[2] is None else (a[1] * B + a[2]) * P + phase[a[0]]
                    for a in program if a[0] in phase]
        if computes != timeline.order[rank]:
            raise ProgramError(f"rank {rank}'s computes are not its timeline order")
        shared = Shared(programs)
        events = check_rank(shared, rank).events
        sent = _check_channels_into(rank, W, shared, sends)
        # the lemma's premise for this rank's waits: each consumed message's send comes after
        # computes of its sender that start before the consumer does, and each all-reduce
        # right after this rank's last weight-gradient job of its stage, alone in its gap
        # (certify: its owners end that job at one time T_s)
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
    """The lemma's premise for an all-reduce (module docstring): the compute before it is this
    rank's last weight-gradient job of its stage, with no other all-reduce in between, and
    it waits for no gradient message."""
    action = program[index]
    stage = action[1]
    before = index - 1
    while before >= 0 and program[before][0] not in (Op.F, Op.B, Op.W):
        if program[before][0] is Op.ALLREDUCE_G:
            before = -1
            break
        before -= 1
    later = any(a[0] is grad_op and a[1] == stage for a in program[index + 1:])
    if consumed or before < 0 or program[before][0] is not grad_op or \
            program[before][1] != stage or later:
        raise ProgramError(f"rank {rank} at action {index} ('{action}'): an all-reduce not "
                           "right after this rank's last gradient job of its stage is outside "
                           "the argument (proof.py)")


def _check_channels_into(
    rank: int, W: int, shared: Shared, sends: dict[Channel, list[tuple[Message, int]]],
) -> dict[int, list[tuple[int, int]]]:
    """The rank's posts on every channel into it carry the messages sent on it, in order
    (:func:`.program.check_channel`); returns per channel number (the dry run's) each send's
    (sender, gap in the sender's program)."""
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
