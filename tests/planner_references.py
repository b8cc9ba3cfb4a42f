"""Plain references for the planner's fast paths (tests/test_schedule_fast_paths.py).

Each function here is the straightforward algorithm a fast path in ``lightning_gsched.schedule``
replaced (issue 14: W=64, S=64, B=256 in well under a second), written for clarity, on the
public types (Jobs, Slots, Actions) and for small sizes only:

- :func:`reference_simulate`: the greedy rule as stated, by scanning every ready job each step;
- :func:`reference_lower`: the lowering with one (gap, category, time, serial) key per action,
  every message put the same way, the FIFO fix over every action, one sort per rank;
- :func:`reference_dry_run`: every rank stepped one action at a time, messages and jobs as
  tuples, until nothing moves.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict

from lightning_gsched.errors import CapTooSmallError, ProgramError
from lightning_gsched.schedule.jobs import Phase, StageGraph, all_jobs
from lightning_gsched.schedule.program import (
    BACKWARD_OPS,
    CHANNEL_OF,
    COLLECTIVE_OPS,
    RECV_FOR_SEND,
    RECV_OPS,
    SEND_OPS,
    Action,
    Op,
    Programs,
)
from lightning_gsched.schedule.simulate import Slot

# ---------------------------------------------------------------- simulation


def reference_simulate(graph: StageGraph, table, ranks, costs, caps) -> list[Slot]:
    """The slots in the order they are placed: each step, among every ready job whose worker may
    start it (a forward only below the worker's cap), the smallest (start, rank) runs, start =
    max(the worker's free time, the job's ready time). A reserving placement (reserve.py)
    charges a microbatch's first forward on a worker all its stashes there and its later
    forwards nothing: a forward may start while the count plus its charge is within the cap."""
    jobs = list(all_jobs(graph.num_stages, table.micro, graph.forward_only, graph.split_backward))
    rank_of = {job: ranks[i] for i, job in enumerate(jobs)}
    missing = {job: len(graph.pred(job)) for job in jobs}
    ready_time = {job: 0.0 for job in jobs}
    ready = [job for job in jobs if missing[job] == 0]
    free = [0.0] * table.workers
    stash = [0] * table.workers
    release = Phase.W if graph.split_backward else Phase.B
    charge = {}
    for job in jobs:
        if job.phase is Phase.F:
            w = table.compute[job.stage][job.micro]
            mine = [s for s in range(graph.num_stages) if table.compute[s][job.micro] == w]
            first = job.stage == mine[0]
            charge[job] = (len(mine) if first else 0) if table.reserves_stash else 1
    slots = []
    while ready:
        best = None
        for job in ready:
            w = table.compute[job.stage][job.micro]
            if job.phase is Phase.F and caps[w] is not None and stash[w] + charge[job] > caps[w]:
                continue
            key = (max(free[w], ready_time[job]), rank_of[job])
            if best is None or key < best[0]:
                best = (key, job, w)
        if best is None:
            raise CapTooSmallError("reference: no worker can start anything")
        (start, _), job, w = best
        ready.remove(job)
        end = start + costs.of(job)
        free[w] = end
        stash[w] += charge[job] if job.phase is Phase.F else -1 if job.phase is release else 0
        slots.append(Slot(job, w, start, end))
        for nxt in graph.succ(job):
            missing[nxt] -= 1
            ready_time[nxt] = max(ready_time[nxt], end)
            if missing[nxt] == 0:
                ready.append(nxt)
    return slots


# ---------------------------------------------------------------- lowering

_CATEGORY = {
    Op.SEND_ACT: 0, Op.SEND_GRAD: 0, Op.REDUCE_G: 1, Op.FREE_W: 2, Op.SEND_W: 3, Op.RECV_G: 4,
    Op.ALLREDUCE_G: 5, Op.FETCH_W: 6, Op.RECV_ACT: 7, Op.RECV_GRAD: 7,
}


class _Keyed:
    """Actions per rank with (gap, category, time, serial) keys; gap g comes before compute g."""

    def __init__(self, by_worker):
        self.by_worker = by_worker
        self.entries = [[] for _ in by_worker]
        self.serial = 0

    def put(self, rank, gap, time, action):
        self.serial += 1
        self.entries[rank].append(((gap, _CATEGORY[action.op], time, self.serial), action))

    def gap_at(self, rank, time):
        return bisect.bisect_left([slot.start for slot in self.by_worker[rank]], time)


def reference_lower(graph, table, timeline, fetch_window=None, ties=None):
    """Per-rank action lists as the lowering's rules define them (see lower.py's docstring)."""
    by_worker = timeline.by_worker
    build = _Keyed(by_worker)
    grad_phase = Phase.W if graph.split_backward else Phase.B
    _reference_data_flow(graph, table, by_worker, build)
    reduce_gaps = _reference_weights(table, by_worker, build, grad_phase, fetch_window)
    if not graph.forward_only:
        _reference_allreduce(table, by_worker, build, reduce_gaps, grad_phase)
    for home, readers in (ties or {}).items():
        _reference_tie(home, readers, table, by_worker, build, grad_phase, graph.forward_only)
    reference_make_fifo(build.entries)
    programs = []
    for rank, entries in enumerate(build.entries):
        keyed = [((i, 99), Action(Op(slot.job.phase.value), slot.job.stage, slot.job.micro))
                 for i, slot in enumerate(by_worker[rank])]
        programs.append([action for _, action in sorted(keyed + entries, key=lambda e: e[0])])
    return programs


def _reference_data_flow(graph, table, by_worker, build):
    index = {slot.job: i for slots in by_worker for i, slot in enumerate(slots)}
    kinds = {Phase.F: (Op.SEND_ACT, Op.RECV_ACT), Phase.B: (Op.SEND_GRAD, Op.RECV_GRAD)}
    done = set()
    for worker, slots in enumerate(by_worker):
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
                build.put(src, produced + 1, by_worker[src][produced].end,
                          Action(send, other, b, worker))
                build.put(worker, max(i - 1, 0), slot.start, Action(recv, other, b, src))


def _reference_weights(table, by_worker, build, grad_phase, fetch_window):
    reduce_gaps = {}
    for worker, slots in enumerate(by_worker):
        owned = set(table.owned_stages(worker))
        freed_at = []
        i = 0
        while i < len(slots):
            stage = slots[i].job.stage
            j = i
            while j + 1 < len(slots) and slots[j + 1].job.stage == stage:
                j += 1
            if stage not in owned:
                owner = table.fetch_source[(stage, worker)]
                fetch_gap = max(i - 1, 0)
                if fetch_window is not None and len(freed_at) >= fetch_window:
                    fetch_gap = max(fetch_gap, freed_at[-fetch_window])
                time = slots[fetch_gap].start if i > 0 else 0.0
                build.put(worker, fetch_gap, time, Action(Op.FETCH_W, stage, None, owner))
                build.put(owner, build.gap_at(owner, time), time,
                          Action(Op.SEND_W, stage, None, worker))
                if any(slots[k].job.phase is grad_phase for k in range(i, j + 1)):
                    end = slots[j].end
                    build.put(worker, j + 1, end, Action(Op.REDUCE_G, stage, None, owner))
                    gap = build.gap_at(owner, end)
                    build.put(owner, gap, end, Action(Op.RECV_G, stage, None, worker))
                    reduce_gaps[(owner, stage)] = max(reduce_gaps.get((owner, stage), 0), gap)
                build.put(worker, j + 1, slots[j].end, Action(Op.FREE_W, stage))
                freed_at.append(j + 1)
            i = j + 1
    return reduce_gaps


def _reference_allreduce(table, by_worker, build, reduce_gaps, grad_phase):
    last = {}
    for worker, slots in enumerate(by_worker):
        for i, slot in enumerate(slots):
            if slot.job.phase is grad_phase:
                last[(worker, slot.job.stage)] = (i + 1, slot.end)
    for stage, owners in enumerate(table.owners):
        if len(owners) > 1:
            for owner in owners:
                gap, time = last.get((owner, stage), (0, 0.0))
                gap = max(gap, reduce_gaps.get((owner, stage), 0))
                build.put(owner, gap, time, Action(Op.ALLREDUCE_G, stage, None, None, owners))


def _reference_tie(home, readers, table, by_worker, build, grad_phase, forward_only):
    owners = table.owners[home]
    recv_gaps, own_last = {}, {}
    for worker, slots in enumerate(by_worker):
        jobs = [i for i, slot in enumerate(slots) if slot.job.stage in readers]
        if not jobs:
            continue
        grads = [] if forward_only else [i for i in jobs if slots[i].job.phase is grad_phase]
        if worker in owners:
            if grads:
                own_last[worker] = (grads[-1] + 1, slots[grads[-1]].end)
            continue
        source = table.fetch_source.get((home, worker), owners[0])
        fetch_gap = max(jobs[0] - 1, 0)
        time = slots[fetch_gap].start if jobs[0] > 0 else 0.0
        build.put(worker, fetch_gap, time, Action(Op.FETCH_W, home, None, source, None, True))
        build.put(source, build.gap_at(source, time), time,
                  Action(Op.SEND_W, home, None, worker, None, True))
        if grads:
            end = slots[grads[-1]].end
            build.put(worker, grads[-1] + 1, end, Action(Op.REDUCE_G, home, None, source, None, True))
            gap = build.gap_at(source, end)
            build.put(source, gap, end, Action(Op.RECV_G, home, None, worker, None, True))
            recv_gaps[source] = max(recv_gaps.get(source, 0), gap)
        build.put(worker, jobs[-1] + 1, slots[jobs[-1]].end,
                  Action(Op.FREE_W, home, None, None, None, True))
    if len(owners) > 1 and not forward_only:
        for owner in owners:
            gap, time = own_last.get(owner, (0, 0.0))
            gap = max(gap, recv_gaps.get(owner, 0))
            build.put(owner, gap, time, Action(Op.ALLREDUCE_G, home, None, None, owners, True))


def reference_make_fifo(all_entries):
    """Walking each channel's sends from last to first, the k-th post of a message takes the
    smaller of its key and the next matched post's (posts only move earlier), then its send
    position; returns how many posts moved."""
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
    moved = 0
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
            if running is not None and key[:4] > running:
                moved += 1
                key = running
            else:
                key = key[:4]
            running = key
            all_entries[dst][matched[position]] = ((*key, position), recv)
    return moved


# ---------------------------------------------------------------- dry run


def reference_dry_run(programs: Programs) -> None:
    """Raise ProgramError unless the programs run: matched FIFO channels, collectives in one
    order per group, each action's rules (see dryrun.py's docstring), no deadlock, every job
    once. Ranks step one action at a time; an action that must wait leaves its rank there."""
    W = programs.world_size
    if programs.forward_only and any(a.op in BACKWARD_OPS for p in programs.ranks for a in p):
        raise ProgramError("forward-only programs contain a backward action")
    sent_idents, posted_idents, orders = defaultdict(list), defaultdict(list), defaultdict(dict)
    for rank, program in enumerate(programs.ranks):
        for a in program:
            if a.op in SEND_OPS or a.op in RECV_OPS:
                if a.peer not in range(W) or (a.op in (Op.SEND_ACT, Op.RECV_ACT, Op.SEND_GRAD,
                                                       Op.RECV_GRAD)
                                              and a.micro not in range(programs.num_micro)):
                    raise ProgramError(f"bad peer or microbatch in '{a}'")
            if a.op in SEND_OPS:
                sent_idents[(CHANNEL_OF[a.op], rank, a.peer)].append(
                    (RECV_FOR_SEND[a.op], a.stage, a.micro, a.tie))
            elif a.op in RECV_OPS:
                posted_idents[(CHANNEL_OF[a.op], a.peer, rank)].append(
                    (a.op, a.stage, a.micro, a.tie))
            elif a.op in COLLECTIVE_OPS:
                if a.group is None or rank not in a.group:
                    raise ProgramError(f"rank {rank} is not in the group of '{a}'")
                orders[a.group].setdefault(rank, []).append((a.op, a.stage, a.tie))
    for channel in set(sent_idents) | set(posted_idents):
        if sent_idents.get(channel, []) != posted_idents.get(channel, []):
            raise ProgramError(f"channel {channel} does not match")
    for group, by_rank in orders.items():
        if any(by_rank.get(r) != by_rank.get(group[0]) for r in group):
            raise ProgramError(f"group {group} all-reduces in different orders")
    inputs, outputs = defaultdict(list), defaultdict(list)
    for u, v in programs.edges:
        inputs[v].append(u)
        outputs[u].append(v)
    state = [_RankState(programs, r) for r in range(W)]
    sent, posted, arrived = Counter(), Counter(), defaultdict(set)
    pc = [0] * W
    moved = True
    while moved:
        moved = False
        for rank in range(W):
            while pc[rank] < len(programs.ranks[rank]):
                action = programs.ranks[rank][pc[rank]]
                if not _step(programs, state[rank], rank, action, inputs, outputs, sent, posted,
                             arrived):
                    break
                pc[rank] += 1
                moved = True
    for rank in range(W):
        if pc[rank] < len(programs.ranks[rank]):
            raise ProgramError(f"deadlock: rank {rank} waits at {programs.ranks[rank][pc[rank]]}")
        st = state[rank]
        if st.stash or any(m is not None for m in st.resident.values()) or any(
                m is not None for m in st.ties.values()):
            raise ProgramError(f"rank {rank} ends holding a stash or fetched weights")
    phases = ["F"] if programs.forward_only else ["B", "W"] if programs.split_backward else ["B"]
    for phase in phases:
        runs = Counter(job for st in state for job in st.done[phase])
        for s in range(programs.num_stages):
            for b in range(programs.num_micro):
                if runs[(s, b)] != 1:
                    raise ProgramError(f"job {phase} s{s} b{b} runs {runs[(s, b)]} times")


class _RankState:
    def __init__(self, programs, rank):
        self.resident = {s: None for s in programs.owned_stages(rank)}
        self.ties = {h: None for h in programs.owned_ties(rank)}
        self.posted = {}  # (recv op, stage, micro) -> message (channel, k)
        self.pending = defaultdict(list)  # (stage, tie) -> gradient messages for an all-reduce
        self.stash, self.grad_stages, self.unreduced = set(), set(), set()
        self.done = {"F": set(), "B": set(), "W": set()}


def _ties_read_by(programs, s):
    return [h for h in sorted(programs.ties) if s in programs.ties[h]]


def _step(programs, st, rank, a, inputs, outputs, sent, posted, arrived) -> bool:
    """Run one action (True) or leave it waiting (False); raise if it breaks a rule."""
    op, s, b = a.op, a.stage, a.micro
    if op in SEND_OPS:
        if op is Op.REDUCE_G and not a.tie and s not in st.grad_stages:
            raise ProgramError(f"'{a}' without a weight-gradient job")
        if op is Op.REDUCE_G and a.tie:
            if s not in st.unreduced:
                raise ProgramError(f"'{a}' holds no tie gradient")
            st.unreduced.discard(s)
        sent[(CHANNEL_OF[op], rank, a.peer)] += 1
        return True
    if op in RECV_OPS:
        channel = (CHANNEL_OF[op], a.peer, rank)
        posted[channel] += 1
        message = (channel, posted[channel])
        if op is Op.FETCH_W:
            held = st.ties if a.tie else st.resident
            if s in held:
                raise ProgramError(f"'{a}' fetches what is resident")
            held[s] = message
        elif op is Op.RECV_G:
            st.pending[(s, a.tie)].append(message)
        else:
            st.posted[(op, s, b)] = message
        return True
    if op is Op.FREE_W:
        held = st.ties if a.tie else st.resident
        if held.get(s, "missing") in (None, "missing") or (a.tie and s in st.unreduced):
            raise ProgramError(f"'{a}' frees what was not fetched, or an unsent gradient")
        del held[s]
        return True
    if op in COLLECTIVE_OPS:
        pending = st.pending[(s, a.tie)]
        if any(sent[c] < k for c, k in pending):
            return False
        key = (a.group, op, s, a.tie)
        arrived[key].add(rank)
        if len(arrived[key]) < len(a.group):
            return False
        pending.clear()
        return True
    # a compute
    if s not in st.resident:
        raise ProgramError(f"'{a}' without its stage's weights")
    if b not in range(programs.num_micro):
        raise ProgramError(f"'{a}' names no microbatch of these programs")
    needed = [] if st.resident[s] is None else [st.resident[s]]
    for h in _ties_read_by(programs, s):
        if h not in st.ties:
            raise ProgramError(f"'{a}' without tie {h}")
        if st.ties[h] is not None:
            needed.append(st.ties[h])
    job = (s, b)
    if op is Op.F:
        sources, done_key, recv = inputs[s], "F", Op.RECV_ACT
        if job in st.done["F"]:
            raise ProgramError(f"'{a}' twice")
    elif op is Op.B:
        sources, done_key, recv = outputs[s], "B", Op.RECV_GRAD
        if job not in st.stash or job in st.done["B"]:
            raise ProgramError(f"'{a}' without its stash, or twice")
    else:
        sources, done_key, recv = [], "W", None
        if not programs.split_backward or job not in st.done["B"] or job not in st.stash:
            raise ProgramError(f"'{a}' before its B, or in programs without W")
    for other in sources:
        if (other, b) not in st.done[done_key]:
            if (recv, other, b) not in st.posted:
                raise ProgramError(f"'{a}' misses an input")
            needed.append(st.posted[(recv, other, b)])
    if any(sent[c] < k for c, k in needed):
        return False
    st.done[done_key].add(job)
    if op is Op.F and not programs.forward_only:
        st.stash.add(job)
    if op is (Op.W if programs.split_backward else Op.B):
        st.stash.discard(job)
        st.grad_stages.add(s)
        st.unreduced.update(h for h in _ties_read_by(programs, s) if st.ties.get(h) is not None)
    return True


def plan_general_graph(edges, *, workers, stages, microbatches, placement, order="1f1b",
                       split_backward=False, cap=None):
    """A Plan of a stage graph other than a chain, built from the planner's own steps.

    ``plan()`` refuses such graphs while the runtime executes chains only (issue 26), but the
    simulator, the lowering, the dry run and the replays follow any graph; this is their
    planning-only entry for tests (default costs F=1, B=2, no cap unless given, verified).
    """
    from lightning_gsched.schedule.dryrun import dry_run
    from lightning_gsched.schedule.lower import lower
    from lightning_gsched.schedule.metrics import measure
    from lightning_gsched.schedule.orders import normalise_caps, resolve_order
    from lightning_gsched.schedule.placements import PlacementTable
    from lightning_gsched.schedule.plan import Plan
    from lightning_gsched.schedule.priorities import priority_ranks
    from lightning_gsched.schedule.simulate import Costs, simulate

    graph = StageGraph(stages, edges, split_backward=split_backward)
    table = PlacementTable(placement, workers, stages, microbatches)
    costs = Costs.build(stages, split=split_backward)
    ranks = priority_ranks(resolve_order(order, workers, stages, microbatches), stages,
                           microbatches, False, split_backward)
    caps = normalise_caps(cap, workers)
    timeline = simulate(graph, table, ranks, costs, caps)
    programs = lower(graph, table, timeline)
    dry_run(programs)
    return Plan("custom", workers, stages, microbatches, None, order, caps, costs, table,
                timeline, programs, measure(programs, timeline), False, (False,) * stages)
