"""Step time of a plan's programs once the runtime's work takes time: a replay, not a new schedule.

Why: the simulator decides *orders* with compute costs only, and the runtime executes those
orders as they are. On a real machine every message costs its sender and its receiver CPU and
takes time to arrive, a gradient all-reduce or hand-off to the owner runs after the last
backward of a stage, a weight fetch must arrive before the stage computes, and the executor
spends its own time around every job. ``predict_step_time`` walks every rank's program in order
(a handler of the program walker, :mod:`.walk`), with the runtime's dependencies, and charges
each of those to the worker where the runtime spends it; compute and order stay the plan's.
With all costs 0 it returns the plan's own latency.

What is charged (``costs``: a :class:`~.runtime_costs.RuntimeCosts`; ``sizes``: the bytes of
:class:`~.memory.ModelSizes`, which say how large each message is):

* a compute job ``F``/``B``/``W`` starts when its worker is free, its inputs have arrived and
  its fetched weights are resident, plus the receive CPU of each message it consumes; it lasts
  its planned cost plus ``job_cpu``;
* a send (``SEND_ACT``, ``SEND_GRAD``, ``SEND_W``, ``REDUCE_G``) advances its worker's clock by
  ``send_time(bytes)`` (``send_cpu`` + bytes x ``send_cpu_per_byte``); the message leaves once
  the fixed ``send_cpu`` is spent (the sender writes its bytes while they flow: its per-byte
  CPU overlaps the flight), or when the receive is posted if that is later (gloo moves the
  bytes once both ends are there), and arrives ``latency + bytes / bandwidth`` later. Bytes: the
  stage's output for an activation, the producing stage's output for an input-gradient, the
  stage's weights for a fetch, its gradients for a hand-off;
* a posted receive (``RECV_*``, ``FETCH_W``) is consumed by the first action that needs it: the
  compute that reads it, ``FREE_W`` for an unused fetch, ``ALLREDUCE_G`` (or the end of the
  step) for a peer's gradient; the consumer waits for the arrival, then pays
  ``recv_time(bytes)``;
* ``ALLREDUCE_G`` of stage s among n ranks: asynchronous, started when every member has reached
  it, finished ``allreduce_time(grads bytes, n)`` later;
* ties (``plan.ties``, see :mod:`.lower_weights`) are weight units charged like a stage's
  weights, with the tie's parameter and gradient bytes (``sizes.ties``); a tie's fetch is
  consumed by the first compute of a stage reading the tie (or by its free);
* a worker's step ends when its last job, its reductions and its sends (the runtime drains
  them) are done, plus ``step_cpu``.

Not modelled: contention of several transfers for one link or of communication threads for
the cores that compute, and the optimizer step after the programs.

Which action consumes which input (the jobs a compute reads, the fetched units it needs, the
fetch a free releases, the gradients an all-reduce sums in) is the shared rules of
:mod:`.consumption`, which the dry run, the bytes walk and the runtime read too.

Adding an op (e.g. a new message kind): give its send its bytes in :class:`_Charges` (and a
fixed extra time if any) and its receive a consumer in :mod:`.consumption`; the rest follows
from the op table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule.consumption import OpRules, UnitKey, unit_of
from lightning_gsched.schedule.jobs import Job, Phase
from lightning_gsched.schedule.memory import ModelSizes
from lightning_gsched.schedule.program import Action, Message, Op
from lightning_gsched.schedule.runtime_costs import ZERO_COSTS, RuntimeCosts
from lightning_gsched.schedule.walk import Walker


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds (or cost units) of one step of a plan's programs."""

    latency: float  # end of the last worker's step (jobs, reductions, sends, step_cpu)
    compute_only: float  # the plan's own latency (every communication cost 0)
    worker_end: tuple[float, ...]  # per worker: the end of its step


# A message's identity, the same on both ends: (message, src, dst, occurrence). The k-th send
# of a key matches the k-th receive of it (channels are FIFO per (src, dst)).
MessageKey = tuple[Message, int, int, int]
_RECV_OF_PHASE = {Phase.F: Op.RECV_ACT, Phase.B: Op.RECV_GRAD}
_PHASE = {Op.F: Phase.F, Op.B: Phase.B, Op.W: Phase.W}


class _Charges:
    """Seconds per message kind and stage, from the cost model and the bytes."""

    def __init__(self, costs: RuntimeCosts, sizes: ModelSizes | None, rules: OpRules) -> None:
        S = rules.num_stages
        if sizes is not None and len(sizes.stages) != S:
            raise ScheduleConfigError(
                f"sizes: {len(sizes.stages)} stages given for a plan of {S} stages"
            )
        st = sizes.stages if sizes is not None else None
        tie_sizes = sizes.ties if sizes is not None else {}
        out = [st[s].message if st else 0 for s in range(S)]
        grad_in = [max((out[p] for p in rules.act_from[s]), default=0) for s in range(S)]
        self.costs = costs
        # bytes of one message (named by the receive that posts it and whether it is a tie's)
        # per stage (a tie is named by its home stage)
        self._bytes: dict[tuple[Op, bool], list[int]] = {
            (Op.RECV_ACT, False): out,
            (Op.RECV_GRAD, False): grad_in,
            (Op.FETCH_W, False): [st[s].params if st else 0 for s in range(S)],
            (Op.RECV_G, False): [st[s].grads if st else 0 for s in range(S)],
            (Op.FETCH_W, True): [tie_sizes[s].params if s in tie_sizes else 0 for s in range(S)],
            (Op.RECV_G, True): [tie_sizes[s].grads if s in tie_sizes else 0 for s in range(S)],
        }
        self._flight = {op: [costs.message_time(b) for b in sizes_]
                        for op, sizes_ in self._bytes.items()}
        self._send = {op: [costs.send_time(b) for b in sizes_] for op, sizes_ in self._bytes.items()}
        self._recv = {op: [costs.recv_time(b) for b in sizes_] for op, sizes_ in self._bytes.items()}

    def flight(self, message: Message) -> float:
        """Seconds ``message`` is in flight."""
        return self._flight[(message.op, message.tie)][message.stage]

    def send_cpu(self, message: Message) -> float:
        """The sender's CPU seconds for ``message``."""
        return self._send[(message.op, message.tie)][message.stage]

    def recv_cpu(self, message: Message) -> float:
        """The receiver's CPU seconds for ``message``."""
        return self._recv[(message.op, message.tie)][message.stage]

    def allreduce(self, unit: UnitKey, members: int) -> float:
        """Seconds of the ``ALLREDUCE_G`` of a unit (a stage or a tie) among members."""
        stage, tie = unit
        return self.costs.allreduce_time(self._bytes[(Op.RECV_G, tie)][stage], members)


class _Replay:
    """Walk handler: clocks per worker, messages matched send to receive (module docstring)."""

    def __init__(self, plan: Any, rules: OpRules, walker: Walker, charges: _Charges) -> None:
        W = plan.workers
        self.rules, self.walker, self.charges = rules, walker, charges
        self.cpu = charges.costs
        self.job_costs = plan.costs
        self.done: dict[Job, tuple[float, int]] = {}  # job -> (end, worker)
        self.clock = [0.0] * W
        self.ends = [0.0] * W
        self.sent: dict[MessageKey, float] = {}  # departure (after the sender's fixed CPU)
        self.posted: dict[MessageKey, float] = {}  # when the receiver posted it
        self._occurrences: dict[tuple[Any, ...], int] = {}
        # weight unit -> the posted fetch not yet consumed
        self.fetching: list[dict[UnitKey, MessageKey]] = [{} for _ in range(W)]
        # weight unit -> gradients received for its all-reduce
        self.grads_in: list[dict[UnitKey, list[MessageKey]]] = [{} for _ in range(W)]
        self.sends_of: list[list[MessageKey]] = [[] for _ in range(W)]
        self.reductions: dict[tuple[UnitKey, tuple[int, ...] | None], list[float]] = {}

    # ------------------------------------------------------------------ messages

    def _key(self, side: str, message: Message, src: int, dst: int) -> MessageKey:
        """The next occurrence of ``message`` from ``src`` to ``dst`` on ``side`` ("send" /
        "recv")."""
        base = (side, message, src, dst)
        k = self._occurrences.get(base, 0)
        self._occurrences[base] = k + 1
        return (message, src, dst, k)

    def arrival(self, key: MessageKey) -> float:
        """When the bytes are at the receiver (both ends known)."""
        start = max(self.sent[key], self.posted.get(key, 0.0))
        return start + self.charges.flight(key[0])

    def _consume(self, at: float, keys: Sequence[MessageKey]) -> float | MessageKey:
        """``at`` after waiting for ``keys`` and paying each one's receive CPU; or the first
        key whose send has not happened yet (wait for it)."""
        for key in keys:
            if key not in self.sent:
                return key
        for key in sorted(keys, key=self.arrival):
            at = max(at, self.arrival(key)) + self.charges.recv_cpu(key[0])
        return at

    # ------------------------------------------------------------------ walk handler

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
        self.clock[w] += self.charges.send_cpu(key[0])
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

    # ------------------------------------------------------------------ end of step

    def worker_ends(self, workers: int) -> list[float]:
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
                      sizes: ModelSizes | None = None,
                      edges: Sequence[tuple[int, int]] | None = None) -> StepPrediction:
    """Replay ``plan``'s programs with the runtime's costs (see the module docstring).

    ``plan``: a :class:`~lightning_gsched.schedule.plan.Plan`; its ``costs`` give the compute
    time of every job. ``costs``: what messages, reductions, jobs and the step cost
    (:class:`RuntimeCosts`; default: nothing). ``sizes``: bytes per stage, for messages' sizes
    (None: every message counts 0 bytes, so only latencies and CPU are charged). ``edges``:
    the stage graph if it is not the programs' own.
    """
    W = plan.workers
    rules = OpRules.of(plan.programs, edges)
    charges = _Charges(costs or ZERO_COSTS, sizes, rules)
    walker = Walker(plan.programs)
    replay = _Replay(plan, rules, walker, charges)
    stuck = walker.run(replay)
    if stuck:
        raise ScheduleConfigError(
            f"the programs of workers {stuck} cannot be replayed (a compute job waits for one "
            "that never runs); were they lowered from this plan?"
        )
    ends = replay.worker_ends(W)
    return StepPrediction(max(ends) if ends else 0.0, plan.metrics.latency, tuple(ends))
