"""The state of one step on one rank: what each action of the program does.

Everything here lives one step (posted receives, produced values, pending gradient receives and
all-reduces, counters) and is dropped at once on a failure, before the executor destroys its
process groups (pending handles keep connections open). :class:`ExecutorState` is what a step
reads of the executor, so that this module need not import it.

:meth:`StepRun.run` dispatches through :data:`HANDLERS`, of functions: bound methods stored on the
instance would be a reference cycle keeping a finished step's tensors alive until the garbage
collector runs. Which input a compute reads is the dry run's rule (``view.rules``); the runtime
runs chains of stages (``check_programs``), so a compute reads at most one message. Weight-unit
ops act on a stage or, with ``Action.tie``, a tie, through that kind's :class:`.UnitTraffic`. A
forward-only run computes without autograd or stash, hands the last stage's output to
``output_fn`` and touches no gradient or statistics.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, Mapping, Protocol

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
from lightning_gsched.runtime.unit_traffic import UnitTraffic
from lightning_gsched.schedule.program import Action, Message, Op


class ExecutorState(Protocol):
    """What one step reads of the :class:`~.executor.ProgramExecutor` that runs it."""

    rank: int
    owned: set[int]
    owned_ties: set[int]
    flats: list[FlatStage]
    ties: dict[int, FlatStage]  # tie home stage -> its unit
    compute: StageCompute
    channels: Channels
    transport: Transport
    running_stats: RunningStats
    memory: MeasuredBytes | None  # sampled after every action when set

    def overlapped_reductions(self, view: ProgramView) -> dict[int, GradBuckets]: ...


class StepRun:
    """State of one step: posted receives, produced values, pending reductions, counters."""

    def __init__(
        self,
        ex: ExecutorState,
        view: ProgramView,
        inputs: Mapping[int, CallArgs],
        loss_fn: LossFn,
        forward_only: bool = False,
        on_computed: Callable[[dict[int, Any]], None] | None = None,
    ) -> None:
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
        buffers = [buf for io in units for buf in io.pending_buffers()]
        communication = sum(m.pending_bytes for m in self.received.values())
        communication += sum(t.numel() * t.element_size() for t in buffers)
        return {"weights": sum(io.resident_bytes() for io in units),
                "gradients": sum(io.active_grad_bytes() for io in units), "optimizer": 0,
                "activations": self.ex.compute.live_activation_bytes(),
                "communication": communication}

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

    def _send_act(self, a: Action, index: int) -> None:
        b = micro_of(a)
        key = (a.stage, b)
        parts = self.produced_acts[key]
        # kept while a forward on this rank still reads it
        if not any((c, b) in self.view.local_forward for c in self.rules.grad_from[a.stage]):
            del self.produced_acts[key]
        self.transport.send_pytree(parts, peer_of(a), label(a, index),
                                   f"output of stage {a.stage} on microbatch {b}")

    def _post_pytree(self, a: Action, index: int) -> None:
        """``RECV_ACT`` / ``RECV_GRAD``: the compute that reads the message takes it."""
        self.received[Message.of(a)] = self.transport.post_pytree(peer_of(a), label(a, index))

    def _send_grad(self, a: Action, index: int) -> None:
        b = micro_of(a)
        key = (a.stage, b)
        grads = self.produced_grads[key]
        if not any((p, b) in self.view.local_backward for p in self.rules.act_from[a.stage]):
            del self.produced_grads[key]
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
    Op.ALLREDUCE_G: StepRun._all_reduce,
}
