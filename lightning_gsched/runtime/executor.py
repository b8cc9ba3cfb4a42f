"""Execute one rank's program for one optimizer step. Op meanings: ``schedule/program.py`` OPS.

``ProgramExecutor(stages, programs)`` is built collectively on every rank (it creates the process
groups). After :meth:`~ProgramExecutor.step` every owner's ``param.grad`` is the gradient of the
mean loss over the B microbatches (replicas and tie owners included) and every rank's running
statistics are one device's after the B microbatches in order (:mod:`.running_stats`).
:meth:`~ProgramExecutor.forward` runs forward-only programs on the same stages, buffers and
channels without touching gradients, so validation can interleave with training. Any failure
raises :class:`RuntimeFault` naming rank, action and cause, after aborting this executor's
channels so that no peer hangs.

A step's state and the handler of every op are :mod:`.step_run`'s (:class:`StepRun`, dropped at
once on a failure, before the executor destroys its process groups).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch
from torch import nn

from lightning_gsched.errors import RuntimeConfigError, RuntimeFault, origin
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.buckets import GradBuckets
from lightning_gsched.runtime.channels import Channels, FaultNotice
from lightning_gsched.runtime.compute import (
    CallArgs,
    ForwardContext,
    LossFn,
    StageCompute,
    check_checkpointed,
)
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.faults import Waiter, is_backend_failure, release_frames
from lightning_gsched.runtime.footprint import MeasuredBytes
from lightning_gsched.runtime.layout import (
    ProgramView,
    StepResult,
    build_flat_stages,
    check_forward_programs,
    check_programs,
    check_ties,
    weight_units,
)
from lightning_gsched.runtime.running_stats import RunningStats
from lightning_gsched.runtime.step_run import StepRun
from lightning_gsched.runtime.transport import TRANSPORTS, Transport, label
from lightning_gsched.schedule.program import OPS, Action, Op, Programs

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
                 tensor_parallel_size: int = 1, notice: FaultNotice | None = None) -> None:
        check_programs(stages, programs)
        if transport not in TRANSPORTS:
            raise RuntimeConfigError(
                f"transport={transport!r} is not one of {list(TRANSPORTS)}; use 'auto' (bare "
                "tensors once shapes are known) or 'described' (shapes sent with every message).")
        checkpointed = check_checkpointed(checkpointed, len(stages))  # before any collective
        check_ties(stages, programs)
        self.running_stats = RunningStats(stages)  # refuses SyncBatchNorm before any collective
        self.channels = channels if channels is not None else Channels(
            programs, timeout=timeout, tensor_parallel_size=tensor_parallel_size, notice=notice)
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
