"""One step of one rank's program: the state a step holds and the handler of every op.

Why a module of its own: :class:`~.executor.ProgramExecutor` owns what lives across steps (the
stages' flat buffers, the channels, the transport, the checks made once); a step's state lives
for one walk of the program and is dropped at once on a failure, before the executor destroys
its process groups (pending handles keep connections open). :meth:`StepRun.run` dispatches
through :data:`HANDLERS`, of functions: bound methods stored on the instance would be a reference
cycle keeping a finished step's tensors alive until the garbage collector runs. Which input a
compute reads is the dry run's rule (``view.rules``); the runtime runs chains of stages
(``check_programs``), so a compute reads at most one message. A forward-only run computes without
autograd or stash and touches no gradient or statistics.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.buckets import GradBuckets
from lightning_gsched.runtime.channels import Channels
from lightning_gsched.runtime.compute import CallArgs, LossFn, StageCompute
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.runtime.footprint import MeasuredBytes
from lightning_gsched.runtime.layout import ProgramView, micro_of, peer_of
from lightning_gsched.runtime.running_stats import RunningStats
from lightning_gsched.runtime.transport import Transport, label
from lightning_gsched.schedule.program import Action, Message, Op


class StepHost(Protocol):
    """What a step reads of the :class:`~.executor.ProgramExecutor` that runs it: what lives
    across steps (a protocol, so that this module stays below the executor)."""

    rank: int
    owned: set[int]
    owned_ties: set[int]
    flats: list[FlatStage]
    ties: dict[int, FlatStage]
    compute: StageCompute
    transport: Transport
    channels: Channels
    running_stats: RunningStats
    memory: MeasuredBytes | None

    def overlapped_reductions(self, view: ProgramView) -> dict[int, GradBuckets]: ...


class UnitTraffic:
    """One kind of weight unit (``kind``: "stage" or "tie") during one step on one rank: fetch,
    serve, free, hand-off and receive of gradients. Stages and ties are both flat units acted on by
    the same ops; :class:`StepRun` keeps what is particular to a kind (bucketed all-reduces of
    stages, ``peak_resident_stages``)."""

    def __init__(self, kind: str, units: Mapping[int, FlatStage], transport: Transport,
                 rank: int) -> None:
        self.kind = kind
        self.units = units
        self.transport = transport
        self.rank = rank
        self.fetches: dict[int, tuple[Any, str]] = {}  # unit -> (work, label) until waited
        self.grad_recvs: dict[int, list[tuple[Any, torch.Tensor, str]]] = {}
        self.reduced: set[int] = set()  # units whose all-reduce has started

    def drop(self) -> None:  # after a failure, before the groups go
        self.fetches.clear()
        self.grad_recvs.clear()

    def fetch(self, a: Action, index: int) -> None:
        unit = self.units[a.stage]
        if unit.resident:
            raise RuntimeConfigError(f"{a.op} of {self.kind} {a.stage}, which is already "
                                     "resident here")
        work = self.transport.post_flat(unit.fetch_buffer(), peer_of(a), "weights")
        self.fetches[a.stage] = (work, label(a, index))

    def serve(self, a: Action, index: int) -> None:
        unit = self.units[a.stage]
        if not unit.owned:
            raise RuntimeConfigError(f"{a.op} of {self.kind} {a.stage}, which rank {self.rank} "
                                     "does not own")
        assert unit.flat is not None  # an owned unit holds its weights
        self.transport.send_flat(unit.flat, peer_of(a), "weights", label(a, index))

    def land(self, key: int) -> None:
        if key in self.fetches:
            work, what = self.fetches.pop(key)
            self.transport.wait(work, what)

    def ready(self, key: int, reader: str) -> None:
        """Before a compute that reads the unit (``reader`` names the reader in an error)."""
        self.land(key)
        unit = self.units[key]
        if not unit.resident:
            raise RuntimeConfigError(
                f"{self.kind} {key}{reader} is not resident on rank {self.rank} (neither owned "
                "nor fetched); the programs do not match this rank. Plan once and pass the same "
                "programs on every rank.")
        unit.materialize()

    def free(self, a: Action, index: int) -> None:
        self.land(a.stage)  # a fetch never used lands first
        unit = self.units[a.stage]
        if unit.grads.active:
            raise RuntimeConfigError(
                f"{a.op} of {self.kind} {a.stage} while its gradient was not sent to the owner "
                "(its REDUCE_G must come first); the programs are not from this planner.")
        unit.free()

    def hand_off(self, a: Action, index: int) -> None:
        grad = self.units[a.stage].take_grads()
        self.transport.send_flat(grad, peer_of(a), "grads", label(a, index))

    def post_grad(self, a: Action, index: int) -> None:
        if a.stage in self.reduced:
            raise RuntimeConfigError(
                f"{a.op} of {self.kind} {a.stage} after its all-reduce started; gradients must "
                "be received before the owners reduce them.")
        unit = self.units[a.stage]
        buffer = torch.empty(unit.grads.numel, dtype=unit.dtype, device=unit.device)
        work = self.transport.post_flat(buffer, peer_of(a), "grads")
        self.grad_recvs.setdefault(a.stage, []).append((work, buffer, label(a, index)))

    def sum_received(self, key: int) -> None:
        """Add the gradients received for the unit into its own (waiting for each)."""
        pending = self.grad_recvs.pop(key, [])
        if not pending:
            return
        total = self.units[key].grads.sync()
        for work, buffer, what in pending:
            self.transport.wait(work, what)
            total.add_(buffer)

    def all_reduce(self, a: Action, index: int, launch: Callable[[torch.Tensor], Any]
                   ) -> tuple[torch.Tensor, list[tuple[Any, str]]]:
        """``ALLREDUCE_G`` without buckets: received gradients summed in, then one all-reduce
        (``launch`` starts it). Returns the gradient and the (work, label) to wait for."""
        self.sum_received(a.stage)
        grad = self.units[a.stage].grads.sync()
        self.reduced.add(a.stage)
        what = f"the all-reduce of {label(a, index)} among ranks {list(a.group or ())}"
        return grad, ([(launch(grad), what)] if grad.numel() else [])

    def finish(self) -> None:
        """End of step: gradients received for units no all-reduce summed in."""
        for key in sorted(self.grad_recvs):
            self.sum_received(key)

    def resident_bytes(self) -> int:
        return sum(u.resident_bytes() for u in self.units.values())



class StepRun:
    """State of one step: posted receives, produced values, pending reductions, counters."""

    def __init__(self, ex: StepHost, view: ProgramView, inputs: Mapping[int, CallArgs],
                 loss_fn: LossFn, forward_only: bool = False,
                 on_computed: Callable[[dict[int, Any]], None] | None = None) -> None:
        self.ex = ex
        self.on_computed = on_computed  # see ProgramExecutor.step
        self.view = view
        self.inputs = inputs
        self.loss_fn = loss_fn  # forward-only: output_fn(output, b) -> anything
        self.forward_only = forward_only
        self.split = view.programs.split_backward  # B then W (zero-bubble programs)
        self.rules = view.rules
        self.transport = ex.transport
        self.counters = RuntimeCounters(owned_stages=len(ex.owned))
        ex.transport.counters = self.counters  # the executor began the transport's step
        self.losses: dict[int, Any] = {}  # forward-only: output_fn's values
        self.received: dict[Message, Any] = {}  # posted RECV_ACT / RECV_GRAD
        self.produced_acts: dict[tuple[int, int], wire.Split] = {}
        self.produced_grads: dict[tuple[int, int], list[Any]] = {}
        self.stage_io = UnitTraffic("stage", dict(enumerate(ex.flats)), ex.transport, ex.rank)
        self.tie_io = UnitTraffic("tie", ex.ties, ex.transport, ex.rank)
        self.allreduces: list[tuple[Any, str]] = []
        # index of a stage's last B -> its bucketed all-reduce, started during that backward
        self.overlap = {} if forward_only else ex.overlapped_reductions(view)
        self.armed: dict[int, GradBuckets] = {}
        # BatchNorm statistics of this step's forwards, folded on every rank at the end
        self.stats = None if forward_only else ex.running_stats.begin_step(view.programs.num_micro)
        self.resident = len(ex.owned)
        self.counters.peak_resident_stages = self.resident
        for unit in [*(ex.flats[s] for s in ex.owned), *(ex.ties[h] for h in ex.owned_ties)]:
            unit.ensure_owned_views()
            if not forward_only:
                unit.zero_grads()
        self._note_bytes()
        if ex.memory is not None:
            ex.memory.sample(self.live_bytes())

    def drop(self) -> None:
        """Forget every pending handle and value (after a failure, before the groups go)."""
        for buckets in self.armed.values():
            buckets.disarm()
        self.armed.clear()
        self.received.clear()
        self.stage_io.drop()
        self.tie_io.drop()
        self.allreduces.clear()
        self.produced_acts.clear()
        self.produced_grads.clear()
        if self.stats is not None:
            self.stats.abandon()

    def run(self, action: Action, index: int) -> None:
        HANDLERS[action.op](self, action, index)
        self.counters.count(action.op, action.tie)
        if self.ex.memory is not None:
            self.ex.memory.sample(self.live_bytes())

    def live_bytes(self) -> dict[str, int]:
        """What this rank holds now, by the planner's categories (runtime/footprint.py)."""
        units = (self.stage_io, self.tie_io)
        # posted receives: pytrees' not yet consumed buffers, gradients not yet summed in
        buffers = [*(t for m in self.received.values() for t in m.buffers or ()),
                   *(t for io in units for recvs in io.grad_recvs.values() for _, t, _ in recvs)]
        grads = [u.grads for io in units for u in io.units.values()]
        return {"weights": sum(io.resident_bytes() for io in units),
                "gradients": sum(g.nbytes for g in grads if g.active), "optimizer": 0,
                "activations": self.ex.compute.live_activation_bytes(),
                "communication": sum(t.numel() * t.element_size() for t in buffers)}

    def _f(self, a: Action, index: int) -> None:
        s, b = a.stage, micro_of(a)
        self._weights_ready(s)
        producers = self.rules.act_from[s]
        if not producers:  # a first stage: the model's input
            args, kwargs = self.inputs[b]
            leaves: list[torch.Tensor] = []
        else:
            (key,) = self.rules.messages_read(a)  # a chain: one producer
            message = self.received.pop(key, None)
            if message is not None:
                value, leaves = self.transport.wait_pytree(message)
            else:
                produced = self.produced_acts.pop((producers[0], b))
                leaves = wire.detached_leaves(produced.tensors)
                value = wire.join(produced.structure, leaves)
            args, kwargs = (value,), {}
        if self.forward_only:
            output = self.ex.compute.infer(s, tuple(args), dict(kwargs))
            if not self.rules.grad_from[s]:  # a sink: nothing reads its output
                self.losses[b] = self.loss_fn(output, b)
            else:
                self.produced_acts[(s, b)] = wire.split(output, what=f"output of stage {s}")
            return
        with self.stats.capture(s, b) if self.stats is not None else nullcontext():
            parts, loss = self.ex.compute.forward(s, b, tuple(args), dict(kwargs), leaves,
                                                  self.loss_fn)
        if loss is not None:
            self.losses[b] = loss
        else:
            assert parts is not None  # not a last stage: its output
            self.produced_acts[(s, b)] = parts
        self.counters.peak_activations = max(self.counters.peak_activations,
                                             self.ex.compute.stashed)

    def _b(self, a: Action, index: int) -> None:
        s, b = a.stage, micro_of(a)
        self._before_reduction(a, "backward")
        self._weights_ready(s)
        if not self.split:
            self._prepare_weight_grads(s, index)
        grads = None
        consumers = self.rules.grad_from[s]
        if consumers:  # else a sink: its backward starts from its own loss
            (key,) = self.rules.messages_read(a)  # a chain: one consumer
            message = self.received.pop(key, None)
            if message is not None:
                grads, _ = self.transport.wait_pytree(message)
            else:
                grads = self.produced_grads.pop((consumers[0], b))
        input_grads = self.ex.compute.backward(s, b, grads, split=self.split)
        if self.rules.narrows_stash(a.op):
            self.ex.compute.narrow_stash(s, b)
        if self.rules.act_from[s]:  # someone's output: its gradient goes back
            self.produced_grads[(s, b)] = input_grads

    def _w(self, a: Action, index: int) -> None:
        s, b = a.stage, micro_of(a)
        self._before_reduction(a, "W")
        self._weights_ready(s)
        self._prepare_weight_grads(s, index)
        self.ex.compute.weight(s, b)

    def _before_reduction(self, a: Action, what: str) -> None:
        """A compute that may touch stage gradients must come before the stage's all-reduce."""
        if a.stage in self.stage_io.reduced:
            raise RuntimeConfigError(
                f"{a} after ALLREDUCE_G of stage {a.stage} started; the all-reduce must come "
                f"after the stage's last {what} on this rank.")

    def _prepare_weight_grads(self, s: int, index: int) -> None:
        """Before a job accumulates stage s's weight gradients (B, or W when split): activate
        its gradient buffer and those of the ties it reads; arm its bucketed all-reduce if this
        is its last such job."""
        for h in self.rules.ties_read[s]:
            if h in self.tie_io.reduced:
                raise RuntimeConfigError(
                    f"a weight-gradient job of stage {s} after ALLREDUCE_G t{h} (tie {h}) "
                    "started; the all-reduce must come after the last weight-gradient job of a "
                    "stage reading the tie on this rank.")
            grads = self.tie_io.units[h].grads
            if not grads.active:
                grads.zero()
        flat = self.ex.flats[s]
        if not flat.grads.active:
            flat.zero_grads()
        buckets = self.overlap.get(index)
        if buckets is not None:
            buckets.arm()
            self.armed[s] = buckets

    def _weights_ready(self, s: int) -> None:
        """Before a job of stage ``s``: its weights and the ties it reads are resident."""
        for h in self.rules.ties_read[s]:
            self.tie_io.ready(h, f" (read by stage {s})")
        self.stage_io.ready(s, "'s weights")

    @staticmethod
    def _take(produced: dict[tuple[int, int], Any], stage: int, b: int,
              readers: Sequence[int], local: Any) -> Any:
        """What ``stage`` produced for microbatch ``b``, to send; kept while a job of this
        rank (``local``: its ``(stage, micro)`` pairs of that phase) still reads it."""
        value = produced[(stage, b)]
        if not any((r, b) in local for r in readers):
            del produced[(stage, b)]
        return value

    def _send_act(self, a: Action, index: int) -> None:
        b = micro_of(a)
        parts = self._take(self.produced_acts, a.stage, b, self.rules.grad_from[a.stage],
                           self.view.local_forward)
        self.transport.send_pytree(parts, peer_of(a), label(a, index),
                                   f"output of stage {a.stage} on microbatch {b}")

    def _post_pytree(self, a: Action, index: int) -> None:
        """``RECV_ACT`` / ``RECV_GRAD``: the compute that reads the message takes it."""
        self.received[Message.of(a)] = self.transport.post_pytree(peer_of(a), label(a, index))

    def _send_grad(self, a: Action, index: int) -> None:
        b = micro_of(a)
        grads = self._take(self.produced_grads, a.stage, b, self.rules.act_from[a.stage],
                           self.view.local_backward)
        parts = wire.split(grads, what=f"input-gradient of stage {a.stage}")
        self.transport.send_pytree(parts, peer_of(a), label(a, index),
                                   f"input-gradient of stage {a.stage} on microbatch {b}")

    def _units(self, a: Action) -> UnitTraffic:
        return self.tie_io if a.tie else self.stage_io

    def _fetch(self, a: Action, index: int) -> None:
        self._units(a).fetch(a, index)
        if not a.tie:  # a tie is no stage (peak_resident_stages), though its bytes count
            self.resident += 1
            self.counters.peak_resident_stages = max(self.counters.peak_resident_stages,
                                                     self.resident)
        self._note_bytes()

    def _serve(self, a: Action, index: int) -> None:
        self._units(a).serve(a, index)

    def _free(self, a: Action, index: int) -> None:
        self._units(a).free(a, index)
        if not a.tie:
            self.resident -= 1

    def _hand_off(self, a: Action, index: int) -> None:
        self._units(a).hand_off(a, index)

    def _post_unit_grad(self, a: Action, index: int) -> None:
        self._units(a).post_grad(a, index)

    def _all_reduce(self, a: Action, index: int) -> None:
        s = a.stage
        buckets = None if a.tie else self.armed.pop(s, None)
        if buckets is not None:  # started bucket by bucket during the last backward
            grad = self.ex.flats[s].grads.flat
            assert grad is not None
            what = f"the all-reduce of {label(a, index)} among ranks {list(a.group or ())}"
            self.allreduces.extend((work, what) for work in buckets.finish())
            self.stage_io.reduced.add(s)
        else:
            grad, works = self._units(a).all_reduce(
                a, index, partial(self.ex.channels.all_reduce, members=a.group))
            self.allreduces.extend(works)
        self.counters.allreduce_bytes += grad.numel() * grad.element_size()

    def finish(self) -> None:
        if self.on_computed is not None:  # every compute is done; the waits below are not
            self.on_computed(self.losses)
        leftovers = [*self.received, *self.stage_io.fetches,
                     *(f"tie {h}" for h in self.tie_io.fetches)]
        self.transport.flush()
        self.stage_io.finish()
        self.tie_io.finish()
        for work, what in self.allreduces:
            self.transport.wait(work, what)
        if self.stats is not None:  # every rank folds all ranks' statistics, microbatch order
            channels, all_reduce = self.ex.channels, None
            if channels.world_size > 1:
                table = self.stats.table
                self.counters.stats_allreduces += 1
                self.counters.stats_allreduce_bytes += table.numel() * table.element_size()
                all_reduce = partial(channels.all_reduce, members=None)
            self.stats.finish(all_reduce, self.transport.wait)
        self.transport.drain_sends()
        self.transport.end_step()
        held = sorted([*self.ex.compute.stash, *self.ex.compute.pending_weights])
        if leftovers or held:
            raise RuntimeConfigError(
                f"rank {self.ex.rank} ends its program with unconsumed receives {leftovers} or "
                f"stashed activations {held}; the programs are inconsistent.")
        self._note_bytes()

    def _note_bytes(self) -> None:
        resident = self.stage_io.resident_bytes() + self.tie_io.resident_bytes()
        self.counters.peak_resident_param_bytes = max(self.counters.peak_resident_param_bytes,
                                                      resident)


# op -> the StepRun method that runs it (see the module docstring)
HANDLERS: dict[Op, Callable[[StepRun, Action, int], None]] = {
    Op.F: StepRun._f, Op.B: StepRun._b, Op.W: StepRun._w,
    Op.SEND_ACT: StepRun._send_act, Op.RECV_ACT: StepRun._post_pytree,
    Op.SEND_GRAD: StepRun._send_grad, Op.RECV_GRAD: StepRun._post_pytree,
    Op.FETCH_W: StepRun._fetch, Op.SEND_W: StepRun._serve, Op.FREE_W: StepRun._free,
    Op.REDUCE_G: StepRun._hand_off, Op.RECV_G: StepRun._post_unit_grad,
    Op.ALLREDUCE_G: StepRun._all_reduce}
