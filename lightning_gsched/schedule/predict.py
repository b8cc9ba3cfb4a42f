"""Step time of a plan's programs once the runtime's work takes time: a replay, not a new schedule.

The simulator orders jobs by compute costs alone; the runtime also spends CPU on every message at
both ends, waits for arrivals, reduces gradients and works around every job. ``predict_step_time``
walks every rank's program (a :mod:`.walk` handler) with the runtime's dependencies and charges
each cost to the worker that spends it; order and compute stay the plan's (all costs 0: the
plan's latency).

* a compute job starts when its worker is free and its inputs and fetched weights have arrived,
  plus the receive CPU of each message it consumes; it lasts its cost plus ``job_cpu``;
* a send advances its worker's clock by ``send_time(bytes)``; the message leaves once the fixed
  ``send_cpu`` is spent (its per-byte CPU overlaps the flight), or when the receive is posted if
  later (gloo moves bytes once both ends are there), and arrives ``message_time(bytes)`` later;
* a posted receive is consumed by the first action that needs it (:mod:`.consumption`), which
  waits for the arrival, then pays ``recv_time(bytes)``;
* ``ALLREDUCE_G`` among n ranks starts when every member has reached it and ends
  ``allreduce_time(bytes, n)`` later, asynchronously; ties are weight units like stages;
* a worker's step ends when its jobs, reductions and sends are done, plus ``step_cpu``.

Not modelled: contention for links or cores, and the optimizer step. A new message kind needs its
bytes in :class:`_Charges` and its receive's consumer in :mod:`.consumption`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule.consumption import OpRules, UnitKey, unit_of
from lightning_gsched.schedule.jobs import Job, Phase
from lightning_gsched.schedule.memory import ModelSizes, StageSizes
from lightning_gsched.schedule.program import Action, Message, Op
from lightning_gsched.schedule.runtime_costs import RuntimeCosts
from lightning_gsched.schedule.walk import Walker


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds (or cost units) of one step."""

    latency: float  # end of the last worker's step (jobs, reductions, sends, step_cpu)
    compute_only: float  # the plan's own latency (every communication cost 0)
    worker_end: tuple[float, ...]  # per worker: the end of its step


# A message's identity, the same on both ends: (message, src, dst, occurrence). The k-th send
# of a key matches the k-th receive of it (channels are FIFO per (src, dst)).
MessageKey = tuple[Message, int, int, int]
_RECV_OF_PHASE = {Phase.F: Op.RECV_ACT, Phase.B: Op.RECV_GRAD}
_PHASE = {Op.F: Phase.F, Op.B: Phase.B, Op.W: Phase.W}


class _Charges:
    """Seconds per message kind (its receive's op, whether a tie's) and stage."""

    def __init__(self, costs: RuntimeCosts, sizes: ModelSizes | None, rules: OpRules) -> None:
        S = rules.num_stages
        if sizes is None:  # every message 0 bytes
            sizes = ModelSizes(tuple(StageSizes(0, 0, 0, 0, 0) for _ in range(S)))
        elif len(sizes.stages) != S:
            raise ScheduleConfigError(
                f"sizes: {len(sizes.stages)} stages given for a plan of {S} stages")
        stages, ties = sizes.stages, sizes.ties
        out = [st.message for st in stages]
        self.costs = costs
        # per stage (a tie: its home stage), the bytes of one message
        self._bytes: dict[tuple[Op, bool], list[int]] = {
            (Op.RECV_ACT, False): out,
            (Op.RECV_GRAD, False): [max((out[p] for p in rules.act_from[s]), default=0)
                                    for s in range(S)],
            (Op.FETCH_W, False): [st.params for st in stages],
            (Op.RECV_G, False): [st.grads for st in stages],
            (Op.FETCH_W, True): [ties[s].params if s in ties else 0 for s in range(S)],
            (Op.RECV_G, True): [ties[s].grads if s in ties else 0 for s in range(S)],
        }
        timed = {"flight": costs.message_time, "send": costs.send_time, "recv": costs.recv_time}
        self._seconds = {kind: {key: list(map(seconds, nbytes))
                                for key, nbytes in self._bytes.items()}
                         for kind, seconds in timed.items()}

    def seconds(self, kind: str, message: Message) -> float:
        """``message``'s ``"flight"``, ``"send"`` (CPU) or ``"recv"`` (CPU) seconds."""
        return self._seconds[kind][(message.op, message.tie)][message.stage]

    def allreduce(self, unit: UnitKey, members: int) -> float:  # a stage's or a tie's
        stage, tie = unit
        return self.costs.allreduce_time(self._bytes[(Op.RECV_G, tie)][stage], members)


class _Replay:
    """Walk handler: clocks per worker, messages matched send to receive (module docstring)."""

    def __init__(self, plan: Any, rules: OpRules, walker: Walker, charges: _Charges) -> None:
        W = plan.workers
        self.rules, self.walker, self.charges = rules, walker, charges
        self.cpu, self.job_costs = charges.costs, plan.costs
        self.done: dict[Job, tuple[float, int]] = {}  # job -> (end, worker)
        self.clock, self.ends = [0.0] * W, [0.0] * W
        self.sent: dict[MessageKey, float] = {}  # departure (after the sender's fixed CPU)
        self.posted: dict[MessageKey, float] = {}  # when the receiver posted it
        self._occurrences: dict[tuple[Any, ...], int] = {}
        self.fetching: list[dict[UnitKey, MessageKey]] = [{} for _ in range(W)]  # not yet used
        # weight unit -> gradients received for its all-reduce
        self.grads_in: list[dict[UnitKey, list[MessageKey]]] = [{} for _ in range(W)]
        self.sends_of: list[list[MessageKey]] = [[] for _ in range(W)]
        self.reductions: dict[tuple[UnitKey, tuple[int, ...] | None], list[float]] = {}

    def _key(self, side: str, message: Message, src: int, dst: int) -> MessageKey:
        """The next occurrence of ``message`` from ``src`` to ``dst`` on ``side`` (send/recv)."""
        base = (side, message, src, dst)
        k = self._occurrences.get(base, 0)
        self._occurrences[base] = k + 1
        return (message, src, dst, k)

    def arrival(self, key: MessageKey) -> float:  # both ends known
        start = max(self.sent[key], self.posted.get(key, 0.0))
        return start + self.charges.seconds("flight", key[0])

    def _consume(self, at: float, keys: Sequence[MessageKey]) -> float | MessageKey:
        """``at`` after waiting for ``keys`` and paying their receive CPU, or a key not sent yet."""
        for key in keys:
            if key not in self.sent:
                return key
        for key in sorted(keys, key=self.arrival):
            at = max(at, self.arrival(key)) + self.charges.seconds("recv", key[0])
        return at

    def compute(self, w: int, a: Action) -> Hashable | None:
        job = Job(a.stage, a.micro, _PHASE[a.op])  # type: ignore[arg-type]  # compute: micro set
        ready = 0.0
        messages: list[MessageKey] = []
        for phase, stage in self.rules.reads(a.op, a.stage):
            pred = Job(stage, job.micro, phase)
            if pred not in self.done:
                return pred  # wait until that job has run
            end, pw = self.done[pred]
            if pw == w:
                ready = max(ready, end)
            else:
                messages.append((Message(_RECV_OF_PHASE[pred.phase], pred.stage, pred.micro),
                                 pw, w, 0))
        needed = self.rules.units_read[a.stage]
        fetching = self.fetching[w]
        messages += [fetching[n] for n in needed if n in fetching]
        start = self._consume(max(self.clock[w], ready), messages)
        if not isinstance(start, float):
            return start
        for n in needed:
            fetching.pop(n, None)
        end = start + self.cpu.job_cpu + self.job_costs.of(job)
        self.done[job] = (end, w)
        self.clock[w] = self.ends[w] = end
        self.walker.wake(job)
        return None

    def send(self, w: int, a: Action) -> Hashable | None:
        assert a.peer is not None
        key = self._key("send", Message.of(a), w, a.peer)
        self.sent[key] = self.clock[w] + self.cpu.send_cpu  # leaves; its bytes flow as written
        self.clock[w] += self.charges.seconds("send", key[0])
        self.sends_of[w].append(key)
        self.walker.wake(key)
        return None

    def recv(self, w: int, a: Action) -> Hashable | None:
        assert a.peer is not None
        key = self._key("recv", Message.of(a), a.peer, w)
        self.posted[key] = self.clock[w]
        if a.op is Op.FETCH_W:
            self.fetching[w][unit_of(a)] = key
        elif a.op is Op.RECV_G:
            self.grads_in[w].setdefault(unit_of(a), []).append(key)
        # activations and input-gradients are consumed by the compute that reads them
        return None

    def free(self, w: int, a: Action) -> Hashable | None:
        name = unit_of(a)
        fetch = self.fetching[w].get(name)
        if fetch is not None:  # fetched but never used: the receive lands first
            at = self._consume(self.clock[w], [fetch])
            if not isinstance(at, float):
                return at
            del self.fetching[w][name]
            self.clock[w] = at
        return None

    def collective(self, w: int, a: Action) -> Hashable | None:
        name = unit_of(a)
        at = self._consume(self.clock[w], self.grads_in[w].get(name, []))
        if not isinstance(at, float):
            return at
        self.grads_in[w].pop(name, None)
        self.clock[w] = at
        self.reductions.setdefault((name, a.group), []).append(at)
        return None

    def worker_ends(self, workers: int) -> list[float]:
        """Each worker's end of step, once the walk is complete (module docstring)."""
        ends = list(self.ends)
        for w in range(workers):
            for key in self.sends_of[w]:  # the runtime drains its sends
                ends[w] = max(ends[w], self.arrival(key))
            for keys in self.grads_in[w].values():  # gradients never all-reduced: summed in
                at = self._consume(ends[w], keys)
                assert isinstance(at, float)  # every send has run once the walk is complete
                ends[w] = at
        for (unit, group), reached in self.reductions.items():
            members = group or tuple(range(workers))
            finish = max(reached) + self.charges.allreduce(unit, len(members))
            for w in members:
                ends[w] = max(ends[w], finish)
        return [end + self.cpu.step_cpu for end in ends]


def predict_step_time(plan: Any, *, costs: RuntimeCosts | None = None,
                      sizes: ModelSizes | None = None) -> StepPrediction:
    """Replay ``plan``'s programs (a :class:`~.plan.Plan`, whose ``costs`` time the jobs) with
    the runtime's ``costs`` (default: nothing) and messages sized by ``sizes`` (None: 0 bytes;
    only latencies and CPU are charged)."""
    rules = OpRules.of(plan.programs)
    walker = Walker(plan.programs)
    replay = _Replay(plan, rules, walker, _Charges(costs or RuntimeCosts(), sizes, rules))
    stuck = walker.run(replay)
    if stuck:
        raise ScheduleConfigError(
            f"the programs of workers {stuck} cannot be replayed (a compute job waits for one "
            "that never runs); were they lowered from this plan?")
    ends = replay.worker_ends(plan.workers)
    return StepPrediction(max(ends) if ends else 0.0, plan.metrics.latency, tuple(ends))
