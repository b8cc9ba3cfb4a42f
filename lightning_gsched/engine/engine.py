"""One run's pipeline steps: global batch -> microbatches -> program -> gradients, losses, logs.

Why separate from the strategies: they speak Lightning (the Trainer's hooks and plugins, Fabric's
setup, save and load), the engine speaks schedules. The Trainer strategy
(:mod:`lightning_gsched.lightning`) and the Fabric strategy (:mod:`lightning_gsched.fabric`) are
thin adapters over this one class, which reaches the runtime only through its facade
:class:`~lightning_gsched.runtime.ModelRuntime`; it imports nothing of Lightning itself
(``tests/test_layering.py`` checks this package). The pipeline is built lazily at the first
batch of the run (:mod:`.build`), because tracing the model needs one real call of ``forward``
and the front ends get no data before that. Every rank receives the same first microbatch, so
everything decided at that point (the probe of the user's step, the partition, the programs) is
identical on every rank, and a contract error is raised by every rank at once instead of
leaving some ranks waiting. ``schedule="auto"`` is decided there too, before the partition
(:mod:`.auto`: rank 0 tunes, every rank gets its pick). A step's rows move point to point, each
to the ranks whose programs read it (:mod:`.step_rows`, over :mod:`.rows` and :mod:`.batches`),
unless every rank of a replica loaded its batch (``data_loading="per_replica"``: nothing moves,
the batches are checked with the losses).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from torch import nn

from lightning_gsched.engine.batches import STAMP_SIZE, local_outputs
from lightning_gsched.engine.build import PipelineBuild
from lightning_gsched.engine.intercept import CallArgs, StepCaller, step_loss
from lightning_gsched.engine.logsync import (
    LossLogExchange,
    PendingExchange,
    exchange,
    on_host,
    reduce_records,
)
from lightning_gsched.engine.step_outputs import (
    rank_step_outputs,
    training_extras,
    warn_if_large,
)
from lightning_gsched.engine.step_rows import Held
from lightning_gsched.engine.values import to_cpu, to_device
from lightning_gsched.errors import GschedError, RuntimeFault, StrategyConfigError
from lightning_gsched.partition.tensor_parallel_state import gather_shards
from lightning_gsched.runtime import stage_micros


@dataclass
class StepOutcome:
    """What a step gives back to its front end.

    ``value``: the training loss (the mean over the global batch's microbatches, the same on
    every rank), or for a forward-only step the outputs of this rank's rows (None when not
    kept). ``extras``: a training step's other returned keys for this rank's rows, when asked
    for and returned (:mod:`.step_outputs`; else None). ``logged``: ``(name, value,
    options)`` reduced over the global batch, for the front end to log on every rank;
    ``rows``: the rows of the global batch (the logged values' batch size: every rank logs the
    global batch's values, so its epoch means weigh each step alike);
    ``notices``: every rank's pending preemption signal at the step's exchange (0: none).
    """

    value: Any
    logged: list[tuple[str, float, dict[str, Any]]]
    rows: int
    notices: list[int] = field(default_factory=list)  # every rank's pending preemption signal
    extras: dict[str, Any] | None = None


# the engines that ran a step and are not closed: how a helper given a submodule of a model
# finds the engine running it (engine_holding)
_RUNNING: weakref.WeakSet[PipelineEngine] = weakref.WeakSet()


def engine_holding(module: nn.Module) -> PipelineEngine | None:
    """The running engine whose model holds ``module``'s parameters (a submodule of it, or the
    model), or None."""
    first = next(module.parameters(), None)
    if first is None:
        return None
    for engine in list(_RUNNING):
        if engine.runtime is not None and any(p is first for p in engine.module.parameters()):
            return engine
    return None


class PipelineEngine(PipelineBuild):
    """Runs a front end's steps through one :class:`ModelRuntime` (see module doc): built at
    the first batch by :class:`~lightning_gsched.engine.build.PipelineBuild` (its arguments),
    then one :meth:`training_step` or :meth:`eval_step` per batch, the gradients handed over,
    and :meth:`close` at the end."""

    # ------------------------------------------------------------------ steps

    def _capture_all(self, caller: StepCaller, micros: Mapping[int, Any],
                     wanted: list[int]) -> dict[int, CallArgs]:
        inputs = {}
        for b in wanted:
            try:
                inputs[b] = caller.capture(micros[b])
            except Exception as exc:
                self._abort(f"rank {self.rank} failed in {caller.name} on microbatch {b} "
                            f"before stage 0: {type(exc).__name__}: {exc}", exc)
        return inputs

    def _abort(self, message: str, exc: BaseException) -> None:
        self.abort(message)
        if isinstance(exc, GschedError) and not isinstance(exc, RuntimeFault):
            raise type(exc)(message) from exc
        raise RuntimeFault(message) from exc

    def training_step(self, batch: Any, caller: StepCaller,
                      notice: Callable[[], int] = lambda: 0,
                      drop_previous_grads: bool = False,
                      keep_extras: bool = False) -> StepOutcome:
        """One schedule step on this rank's share of the global batch: forward, backward and
        the gradients held for :meth:`hand_over_grads`; the loss of the global batch.
        ``notice()``: this rank's pending preemption signal, read when the exchange of the
        losses starts (every rank's comes back in ``StepOutcome.notices``).
        ``drop_previous_grads``: the loop zeroes the gradients before the hand-over
        (``ModelRuntime.step``). ``keep_extras``: a hook reads the step's other returned keys:
        they are gathered (only on steps where the step returned some) and joined for this
        rank's rows (``StepOutcome.extras``)."""
        rows, layouts = self.step_rows.sizes(batch, trusted=self.built)
        held = Held()
        if not self.config.decided:
            held = self.build_auto(batch, rows, caller, training=True)
        B = self.config.training_micro(self.world_size)
        cut = self.step_rows.step_cut(rows, training=True)
        if not self.built:
            held = self.step_rows.first_micro(batch, cut, layouts)
            self.build(caller, held.first(), training=True)
        assert self.train_plan is not None
        micros = self.step_rows.exchange(batch, cut, self.step_rows.needed(self.train_plan),
                                         held, layouts)
        runtime = self.require_runtime()
        _RUNNING.add(self)
        if self.losses_and_logs is None:
            self.losses_and_logs = LossLogExchange(self.world_size, self.rank, B, runtime.device,
                                                   self.control,
                                                   STAMP_SIZE if self.step_rows.stamped else 0)
        inputs = self._capture_all(caller, micros, runtime.first_stage_micros)
        extras: dict[int, Any] = {}

        def loss_fn(output: Any, b: int) -> torch.Tensor:
            result = caller.finish(micros[b], output, b)
            if keep_extras:
                extra = training_extras(result)
                if extra is not None:
                    extras[b] = extra
            return step_loss(result, caller.name)

        exchange_logs = self.losses_and_logs
        pending: list[PendingExchange] = []

        def start_log_exchange(losses: dict[int, Any]) -> None:
            if not self.workers.reports:  # its worker's t = 0 reports the same values
                losses, logs = {}, []
                extras.clear()
            else:
                logs = caller.logs
            pending.append(exchange_logs.start(losses, logs, notice(),
                                               self.step_rows.stamp(batch, rows, layouts),
                                               outputs=bool(extras)))

        self.memory.before_step(runtime)
        try:
            runtime.step(inputs, loss_fn, signature=_signature(caller, rows, layouts),
                         on_computed=start_log_exchange,
                         drop_previous_grads=drop_previous_grads)
        except RuntimeFault:
            self.failed = True
            raise
        self.memory.after_step(runtime, self.optimizers(), self.world_size, self.rank, self.info)
        all_losses, records = self.collective("the loss/log exchange",
                                               lambda: exchange_logs.finish(pending[0]))
        self.step_rows.check_stamps(pending[0].stamps, B)
        if len(all_losses) != B:
            raise StrategyConfigError(
                f"expected one loss per microbatch ({B}), got {sorted(all_losses)}; every rank "
                "must run the same plan"
            )
        loss = torch.tensor(sum(all_losses[b] for b in range(B)) / B, device=runtime.device)
        joined = None
        if pending[0].outputs_anywhere:  # only a step whose ranks returned more than the loss
            shipped = to_cpu(extras)
            warn_if_large(shipped, caller.name)
            gathered = self.collective("the gather of the step's returned values", lambda: (
                exchange(shipped, self.world_size, self.group)))
            by_micro = {b: v for part in gathered for b, v in part.items()}
            joined = to_device(rank_step_outputs(by_micro, cut, self.workers.position,
                                                 caller.name), runtime.device)
        return StepOutcome(loss, reduce_records(records, cut.micro_rows()),
                           sum(cut.micro_rows()),
                           pending[0].notices, joined)

    def eval_step(self, batch: Any, caller: StepCaller,
                  keep_outputs: Literal["predictions", "hooks"] | None,
                  notice: Callable[[], int] = lambda: 0) -> StepOutcome:
        """A forward-only plan (validation, test, predict). ``keep_outputs``: every rank gets
        the step's returns for the rows it loaded, ``"predictions"`` joined strictly (each a
        tensor of rows: predictions go back to their rank, :func:`.batches.local_outputs`),
        ``"hooks"`` as far as they can be (:mod:`.step_outputs`: for the batch-end hooks);
        None: not kept."""
        rows, layouts = self.step_rows.sizes(batch)
        held = Held()
        if not self.config.decided:
            held = self.build_auto(batch, rows, caller, training=False)
        cut = self.step_rows.step_cut(rows, training=False)
        if not self.built:
            held = self.step_rows.first_micro(batch, cut, layouts)
            self.build(caller, held.first(), training=False)
        # after the build: the partition's ties are placed (the same B and placement)
        plan = self.config.eval_plan(self.world_size, sum(rows))
        if plan.micro != cut.parts:
            cut = self.step_rows.step_cut(rows, training=False)
        micros = self.step_rows.exchange(batch, cut, self.step_rows.needed(plan), held, layouts)
        runtime = self.require_runtime()
        _RUNNING.add(self)
        first_micros, _ = stage_micros(plan.programs, self.worker)
        inputs = self._capture_all(caller, micros, first_micros)
        try:
            outputs = runtime.forward(
                plan.programs, inputs, lambda out, b: caller.finish(micros[b], out, b),
                signature=_signature(caller, rows, layouts),
            )
        except RuntimeFault:
            self.failed = True
            raise
        reporting = self.workers.reports  # of a worker's T ranks, t = 0 reports (the same)
        shipped = ({b: to_cpu(v) for b, v in outputs.items()}
                   if keep_outputs and reporting else {})
        if keep_outputs == "hooks":
            warn_if_large(shipped, caller.name)
        # one host read for the step's records
        logs = on_host(caller.logs, runtime.device) if reporting else []
        gathered = self.collective("the evaluation gather", lambda: exchange(
            (shipped, logs, notice()), self.world_size, self.group))
        notices = [n for _, _, n in gathered]
        records = [r for _, logs, _ in gathered for r in logs]
        logged = reduce_records(records, cut.micro_rows())
        global_rows = sum(cut.micro_rows())
        if not keep_outputs:
            return StepOutcome(None, logged, global_rows, notices)
        by_micro = {b: v for part, _, _ in gathered for b, v in part.items()}
        position = self.workers.position
        local = (local_outputs(by_micro, cut, position, caller.name)
                 if keep_outputs == "predictions"
                 else rank_step_outputs(by_micro, cut, position, caller.name))
        return StepOutcome(to_device(local, runtime.device), logged, global_rows, notices)

    # ------------------------------------------------------------------ gradients

    def hand_over_grads(self, scale: float) -> None:
        """The last training step's gradients into ``param.grad`` (see ModelRuntime.hand_over)."""
        if self.runtime is not None:
            self.runtime.hand_over(scale)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                       error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip by the norm of the whole model (each parameter once over all ranks); before the
        first step every rank holds the full model, so torch's own clipping is exact."""
        if self.runtime is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                                  error_if_nonfinite=error_if_nonfinite)
        return self.runtime.clip_grad_norm(params, max_norm, norm_type, error_if_nonfinite)

    def parameter_grad_norms(self, params: list[nn.Parameter], norm_type: float = 2.0
                             ) -> list[torch.Tensor | None]:
        """Each parameter's gradient norm as one device has it, on every rank (collective; None
        where it has no gradient). Before the first step every rank holds the whole model and
        its own gradients, so they are read locally."""
        if self.runtime is None:
            return [p.grad.detach().norm(norm_type) if p.grad is not None else None
                    for p in params]
        return self.runtime.parameter_grad_norms(params, norm_type)

    # ------------------------------------------------------------------ end

    def abort(self, message: str) -> None:
        """This rank failed outside a step (or a peer did): record ``message`` as the job's
        first failure and drop the runtime's and the control group's connections, so every
        peer waiting on this rank stops at once with a RuntimeFault quoting it."""
        self.failed = True
        if self.control is not None:
            # the notice before any connection is dropped: the runtime's abort below closes
            # its groups and collects garbage (up to a second), and a peer in a control
            # collective must find the cause when its connection goes
            self.control.report(message)
        if self.runtime is not None and not self.runtime.closed:
            self.runtime.abort(message)
        if self.tensor_parallel_size > 1 and self.device_mesh is not None:
            # a tensor-parallel peer waits in a layer's collective on the mesh's groups
            self.device_mesh.abort()
        if self.control is not None:
            self.control.abort(message)

    def close(self, gather: bool) -> None:
        """Give every rank the full model again (unless a rank failed) and drop the groups."""
        if self.donation_off is not None:
            self.donation_off.restore()
            self.donation_off = None
        if self.whole_call_guard is not None:
            self.whole_call_guard.remove()
            self.whole_call_guard = None
        _RUNNING.discard(self)
        runtime = self.runtime
        if runtime is None:
            return
        # a failure seen in one of the strategy's own collectives (the control group) counts:
        # the peers are ending, so a gathering collective would wait for them in vain
        failed = self.failed or (self.control is not None and self.control.failed)
        if gather and not failed and not runtime.closed:
            # collective: a peer that failed meanwhile (e.g. in a step this rank never ran:
            # its epoch had one batch more) is named, not only the lost connection
            self.collective("the gather of the full model at the end",
                             lambda: runtime.restore_full_model(self.optimizers()))
            if self.tensor_parallel_size > 1:  # each slice's shards, gathered over its T ranks
                self.collective("the gather of the tensor-parallel shards at the end",
                                 lambda: gather_shards(self.module, self.optimizers()))
        if not gather and not failed and self.tensor_parallel_size == 1 and not runtime.closed:
            runtime.absent_to_meta()  # a checkpoint can be restored into it (module doc there)
        runtime.close()
        self.runtime = None


def _signature(caller: StepCaller, rows: list[int], layouts: list[int]
               ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """What every rank knows of a step's shapes without asking (the runtime sends activations
    as bare tensors for a signature it has seen): the hook, every rank's rows and layout."""
    return caller.name, tuple(rows), tuple(layouts)
