"""Execute one rank's program for one optimizer step. Op meanings: ``schedule/program.py`` OPS.

``ProgramExecutor(stages, programs)`` is built collectively on every rank (it creates the process
groups). After :meth:`~ProgramExecutor.step` every owner's ``param.grad`` is the gradient of the
mean loss over the B microbatches (replicas and tie owners included) and every rank's running
statistics are one device's after the B microbatches in order (:mod:`.running_stats`).
:meth:`~ProgramExecutor.forward` runs forward-only programs on the same stages, buffers and
channels without touching gradients, so validation can interleave with training. Any failure
raises :class:`RuntimeFault` naming rank, action and cause, after aborting this executor's
channels so that no peer hangs.

A step's state (:class:`StepRun`) is dropped at once on a failure, before the executor destroys
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
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch
from torch import nn

from lightning_gsched.errors import RuntimeConfigError, RuntimeFault, origin
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.buckets import GradBuckets
from lightning_gsched.runtime.channels import Channels
from lightning_gsched.runtime.compute import (
    CallArgs,
    ForwardContext,
    LossFn,
    StageCompute,
    check_checkpointed,
)
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.faults import Waiter, is_backend_failure, release_frames
from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.runtime.footprint import MeasuredBytes
from lightning_gsched.runtime.layout import (
    ProgramView,
    StepResult,
    build_flat_stages,
    check_forward_programs,
    check_programs,
    check_ties,
    micro_of,
    peer_of,
    weight_units,
)
from lightning_gsched.runtime.running_stats import RunningStats
from lightning_gsched.runtime.transport import TRANSPORTS, Transport, label
from lightning_gsched.schedule.program import OPS, Action, Message, Op, Programs

# the ops whose message is a pytree (activations, input-gradients): the p2p channel's
_PYTREE_OPS = frozenset(op for op, spec in OPS.items() if spec.channel == "p2p")


class ProgramExecutor:
    """Runs this rank's program of ``programs`` (``plan(...).programs``, the same on every rank)
    over ``stages`` (e.g. ``partition(model, S, ...).stages``; each rank its own replica, built
    identically: same split, same parameter order).

    ``channels``: default new ones (collective, same order everywhere). ``timeout``: seconds any
    single wait may take before the step fails. ``sync_weights``: broadcast replicated stages and
    ties from their first owner, and running statistics from rank 0, so replicas start equal.
    ``forward_context``: entered around every stage forward (e.g. autocast), not the loss or the
    backward. ``checkpointed``: one bool per stage (``plan(...).checkpointed``, :mod:`.compute`).
    ``transport``: ``"auto"`` sends bare tensors once the step signature is known (its first step
    describes each message), ``"described"`` describes every message (data-dependent shapes).
    ``tensor_parallel_size=T``: each worker of the programs is T ranks whose stages were sharded
    over them (partition/tensor_parallel.py); default channels then map worker ``w`` to ranks
    ``w * T + t`` (:class:`Channels`), and :attr:`rank` is the worker.
    """

    def __init__(self, stages: Sequence[nn.Module], programs: Programs, *,
                 channels: Channels | None = None, timeout: float = 300.0,
                 sync_weights: bool = True, forward_context: ForwardContext | None = None,
                 checkpointed: Sequence[bool] | None = None, transport: str = "auto",
                 tensor_parallel_size: int = 1) -> None:
        check_programs(stages, programs)
        if transport not in TRANSPORTS:
            raise RuntimeConfigError(
                f"transport={transport!r} is not one of {list(TRANSPORTS)}; use 'auto' (bare "
                "tensors once shapes are known) or 'described' (shapes sent with every message).")
        checkpointed = check_checkpointed(checkpointed, len(stages))  # before any collective
        check_ties(stages, programs)
        self.running_stats = RunningStats(stages)  # refuses SyncBatchNorm before any collective
        self.channels = channels if channels is not None else Channels(
            programs, timeout=timeout, tensor_parallel_size=tensor_parallel_size)
        self.rank = self.channels.rank
        self.programs = programs
        self.view = ProgramView.of(programs, self.rank)
        self.program: list[Action] = self.view.program
        self.owned = set(programs.owned_stages(self.rank))
        self.owned_ties = set(programs.owned_ties(self.rank))
        self.flats, self.ties, self.device = build_flat_stages(stages, self.owned, self.owned_ties)
        self.compute = StageCompute(stages, programs.num_micro, forward_context, checkpointed)
        # where the walk is: a text, or (action, index) formatted only when a failure reports it
        self._at: str | tuple[Action, int] = "the start of its program"
        self.waiter = Waiter(self.channels.global_rank, self.channels, timeout,
                             lambda: self._position)
        self.transport = Transport(self.channels, self.waiter, self.device, transport)
        self.first_stage_micros = self.view.first_stage_micros
        self.last_stage_micros = self.view.last_stage_micros
        self.last_counters: RuntimeCounters | None = None
        self.last_forward_counters: RuntimeCounters | None = None
        self.memory: MeasuredBytes | None = None  # see record_memory
        # per id(programs), with the programs kept alive so that their id is not reused
        self._messages: dict[int, tuple[Programs, bool]] = {}
        self._overlap: dict[int, tuple[Any, dict[int, GradBuckets]]] = {}
        if sync_weights:
            self._sync_weights()

    def overlapped_reductions(self, view: ProgramView) -> dict[int, GradBuckets]:
        """{index of stage s's last weight-gradient job: its bucketed all-reduce}, cached per
        programs. A stage qualifies when the program all-reduces it, receives no ``RECV_G`` for it
        (those must be added first) and its gradient spans several buckets: a single bucket starts
        when the backward ends, as ``ALLREDUCE_G`` would, so hooks would cost for nothing."""
        key = id(view.programs)
        if key not in self._overlap:
            last_b: dict[int, int] = {}
            groups: dict[int, tuple[int, ...] | None] = {}
            received = set()
            grad_op = view.programs.weight_grad_op
            for i, a in enumerate(view.program):
                if a.op is grad_op:
                    last_b[a.stage] = i
                elif a.op is Op.ALLREDUCE_G and not a.tie:  # a stage's (ties' unbucketed)
                    groups[a.stage] = a.group
                elif a.op is Op.RECV_G and not a.tie:
                    received.add(a.stage)
            plan: dict[int, GradBuckets] = {}
            for stage, group in groups.items():
                grads = self.flats[stage].grads
                if stage in received or stage not in last_b or not grads.numel:
                    continue
                buckets = GradBuckets(grads, partial(self.channels.all_reduce, members=group))
                if len(buckets.buckets) > 1:
                    plan[last_b[stage]] = buckets
            self._overlap[key] = (view.programs, plan)
        return self._overlap[key][1]

    def record_compute_times(self, enabled: bool = True) -> None:
        """Start (or stop) timing every forward and backward this rank runs (see compute_times)."""
        self.compute.times = {} if enabled else None

    def compute_times(self) -> dict[tuple[str, int], list[float]]:
        """Seconds of each recorded ``F``/``B``/``W`` by (phase, stage), waits excluded."""
        return dict(self.compute.times or {})

    def record_memory(self, enabled: bool = True) -> None:
        """Start (afresh) or stop sampling the bytes this rank holds after every action, by the
        planner's categories (:mod:`.footprint`)."""
        self.memory = MeasuredBytes() if enabled else None
        self.compute.saved_bytes = {} if enabled else None
        self.compute.saved_counters.clear()

    def measured_memory(self) -> MeasuredBytes | None:
        """The peaks since :meth:`record_memory` (None when not recording). The optimizer's
        state is not the executor's: ``ModelRuntime.measured_memory`` adds it."""
        return self.memory

    def step(self, inputs: Mapping[int, CallArgs], loss_fn: LossFn, *,
             signature: Hashable | None = None,
             on_computed: Callable[[dict[int, Any]], None] | None = None) -> StepResult:
        """Run this rank's program once: forward, backward and gradient reduction of one step.

        ``inputs``: ``{b: (args, kwargs)}``, stage 0's call on microbatch ``b``: those of
        ``self.first_stage_micros`` run here, the others define the default ``signature``, a
        hashable, the same on every rank, that changes whenever the messages' shapes may (default:
        the shapes, dtypes and plain values of every microbatch's inputs); steps with a known
        signature send bare tensors. ``loss_fn(output, b) -> scalar`` runs for
        ``self.last_stage_micros``. ``on_computed({b: loss})`` runs after this rank's last compute,
        before the step waits for its all-reduces and sends, so that a caller's small collective
        started there overlaps them (it must not wait on this step). Returns the unscaled losses
        of the microbatches that ended here, and the counters.
        """
        state = StepRun(self, self.view, inputs, loss_fn, on_computed=on_computed)
        self._execute(state, "step()", signature)
        self.last_counters = state.counters
        return StepResult(state.losses, state.counters)

    def forward(self, programs: Programs, inputs: Mapping[int, CallArgs],
                output_fn: Callable[[Any, int], Any], *,
                signature: Hashable | None = None) -> dict[int, Any]:
        """Run this rank's program of forward-only ``programs`` (validation, test, predict).

        ``programs``: ``plan(..., forward_only=True).programs`` with this executor's schedule, W,
        S and R (the microbatches may differ, even have 0 rows), the same on every rank; every
        rank must call. ``inputs`` and ``signature`` as in :meth:`step`. Returns
        ``{b: output_fn(output, b)}`` where microbatch ``b``'s last stage runs. Runs under
        ``no_grad`` outside inference mode (so fetched weights never become inference tensors);
        owned gradients and running statistics stay as they were.
        """
        check_forward_programs(self.programs, programs, self.rank)
        view = ProgramView.of(programs, self.rank)
        with torch.inference_mode(False), torch.no_grad(), self.running_stats.unchanged():
            state = StepRun(self, view, inputs, output_fn, forward_only=True)
            self._execute(state, "forward()", signature)
        self.last_forward_counters = state.counters
        return state.losses

    def _execute(self, state: StepRun, caller: str, signature: Hashable | None) -> None:
        """Walk the program; on any failure abort the channels and raise a fault."""
        try:
            self._guarded(self._check_inputs, state.inputs, state.view.first_stage_micros, caller)
            self._guarded(self._begin_transport, state, signature, caller)
            for index, action in enumerate(state.view.program):
                self._at = (action, index)
                self._guarded(state.run, action, index)
            self._at = "the end of its program"
            self._guarded(state.finish)
        except RuntimeFault as fault:
            state.drop()
            release_frames(fault)  # else they keep the groups' connections open
            self.abort(fault.headline or str(fault))
            raise
        finally:
            self._at = "the start of its program"

    @property
    def _position(self) -> str:
        """Where the walk is, for a fault message; with tensor parallelism also whose program
        (the message's "rank" is the process's, several of which run one worker's program)."""
        text = self._at if isinstance(self._at, str) else label(*self._at)
        if self.channels.tensor_parallel[0] > 1:
            text += f" of worker {self.rank}'s program"
        return text

    def _guarded(self, fn: Any, *args: Any) -> None:
        """Run ``fn``; any failure becomes a RuntimeFault naming this rank and its position."""
        try:
            fn(*args)
        except RuntimeFault:
            raise
        except Exception as exc:  # noqa: BLE001 - reported with rank and action
            if is_backend_failure(exc):  # a collective inside the compute (tensor parallelism)
                raise self.waiter.fault("a collective inside the stage", exc, None) from exc
            where = origin(exc)  # the user's hook that raised, when the caller marked it
            raise RuntimeFault(
                f"rank {self.channels.global_rank} failed at {self._position}"
                + (f" in {where}" if where else "") + f": {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Release the process groups and end the send releaser's thread (the executor cannot
        step afterwards). Why the thread: it holds this executor (through the waiter) and so
        every flat buffer; left waiting, each closed executor of a process stayed alive (a
        second fit in the same process counted the first one's 25 MiB, ``memory[...]``)."""
        self.transport.sends.clear()  # every step drained its sends: nothing is dropped
        self.channels.close()

    def _begin_transport(self, state: StepRun, signature: Hashable | None, caller: str) -> None:
        """Start the transport's step under this step's signature (the same on every rank)."""
        programs = state.view.programs
        if signature is not None:
            try:
                hash(signature)
            except TypeError as exc:
                raise RuntimeConfigError(
                    f"{caller}'s signature must be hashable (e.g. a tuple of ints), got "
                    f"{type(signature).__name__}.") from exc
            key: Hashable = ("given", signature)
        elif self.transport.described or not self._has_pytree_messages(programs):
            key = None  # nothing depends on it
        else:
            missing = [b for b in range(programs.num_micro) if b not in state.inputs]
            if missing:
                raise RuntimeConfigError(
                    f"{caller} on rank {self.rank} got no inputs for microbatches {missing}, so "
                    "it cannot tell the step's signature (the input shapes every rank must agree "
                    "on to send activations without their shapes). Pass every microbatch's "
                    f"inputs on every rank, or {caller[:-2]}(..., signature=<the same hashable "
                    "on every rank, e.g. the batch shape>), or build the executor with "
                    "transport='described'.")
            key = ("inputs", tuple(wire.spec_of(wire.split(state.inputs[b], "inputs"))
                                   for b in range(programs.num_micro)))
        self.transport.begin_step(programs, key)

    def _has_pytree_messages(self, programs: Programs) -> bool:
        """Whether this rank's program exchanges pytrees (cached per programs). Only its own: a
        sender and its receiver, the only ranks that must agree on the signature, both have the
        message, and reading every rank's program would lower a lazy plan's all W."""
        key = id(programs)
        if key not in self._messages:
            found = any(a.op in _PYTREE_OPS for a in programs.ranks[self.rank])
            self._messages[key] = (programs, found)
        return self._messages[key][1]

    def _check_inputs(self, inputs: Mapping[int, Any], first: list[int], caller: str) -> None:
        if not isinstance(inputs, Mapping):
            raise RuntimeConfigError(
                f"{caller} takes inputs as {{b: (args, kwargs)}}, got {type(inputs).__name__}.")
        missing = [b for b in first if b not in inputs]
        if missing:
            where = ("executor.first_stage_micros" if caller == "step()"
                     else "stage_micros(programs, rank)[0] of the programs passed to forward()")
            raise RuntimeConfigError(
                f"rank {self.rank} runs stage 0 on microbatches {first} but "
                f"{caller} got no inputs for {missing}; pass {{b: (args, kwargs)}} for (at least) "
                f"{where}.")
        for b in first:
            call = inputs[b]
            if not (isinstance(call, tuple) and len(call) == 2
                    and isinstance(call[0], (tuple, list)) and isinstance(call[1], Mapping)):
                raise RuntimeConfigError(
                    f"inputs[{b}] must be (args, kwargs), e.g. ((x,), {{}}); "
                    f"got {type(call).__name__}.")

    def _sync_weights(self) -> None:
        for owners, flat in weight_units(self.programs, self.flats, self.ties):
            if len(owners) > 1 and self.rank in owners and flat.numel:
                self.channels.broadcast(flat.flat, owners[0], owners)
        if self.channels.world_size > 1:
            self.running_stats.broadcast(partial(self.channels.broadcast, src=0, members=None))

    def abort(self, message: str) -> None:
        """Report ``message`` as the job's failure, drop every handle and destroy the groups, so
        that peers waiting on this rank fail at once quoting it (a failed step, or a front end's
        own code failing between steps)."""
        self.channels.notice.report(message)
        self.transport.drop_all()
        self.compute.stash.clear()
        self.compute.pending_weights.clear()
        self.compute.saved_counters.clear()
        self.channels.close(collect=True)


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

    def __init__(self, ex: ProgramExecutor, view: ProgramView, inputs: Mapping[int, CallArgs],
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
