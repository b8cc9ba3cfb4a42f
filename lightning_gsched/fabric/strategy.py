"""``GeneralParallelFabric``: every library schedule (or your own) as a Lightning Fabric strategy.

Why a class of its own: Fabric accepts ``lightning.fabric.strategies.Strategy`` instances only,
and a Trainer strategy is not one. Why a DDPStrategy subclass: launching (script re-run,
spawn/fork), process groups, cluster environments, ``all_reduce``/``barrier``/``broadcast`` and
the distributed sampler are exactly Fabric's DDP. What differs is that the model is not wrapped,
and that a user's loop cannot call ``loss.backward()`` on a pipelined model: a schedule
interleaves the forwards and backwards of microbatches over the ranks. So one call,
:meth:`GeneralParallelFabric.step`, does forward, backward and the gradient hand-over of one
optimizer step, and the rest of a plain Fabric loop stays as it is.

This class is a thin adapter: the pipeline (probe, partition, plans, the step, the hand-over,
clipping, evaluation) is the shared engine's :class:`~lightning_gsched.engine.PipelineEngine`
(the Trainer strategy's too), checkpoints are the engine's ``CheckpointService`` (``fabric.save``
and ``fabric.load`` translated into its calls, as the Trainer's hooks are), and gradients go
through the same runtime facade (:class:`~lightning_gsched.runtime.ModelRuntime`).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Iterator, Literal, Optional, Sequence, Union

import lightning.fabric.wrappers as fabric_wrappers
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import (
    _BackwardSyncControl,
    _validate_keys_for_strict_loading,
)
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning.fabric.wrappers import _unwrap_objects
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_gsched.engine import (
    FABRIC,
    CheckpointService,
    CheckpointSettings,
    CheckpointView,
    ControlGroup,
    DeviceMeshSlot,
    PipelineEngine,
    PreemptionNotice,
    StepCaller,
    UncaughtExitReport,
    check_launch_arguments,
    check_transport,
    library_names,
    pipeline_keywords,
    pipeline_options,
    sampler_kwargs,
    tensor_parallel_options,
)
from lightning_gsched.errors import PreemptedError, StrategyConfigError, error_text
from lightning_gsched.runtime import (
    deferred_parameters,
    lightning_reduce,
    pretrained_weights,
)


class _ReducedEveryStep(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)`` under GeneralParallelFabric: accepted, and changes
    nothing. Each :meth:`GeneralParallelFabric.step` reduces its gradients inside the schedule
    and adds them to ``param.grad``, so accumulating over several steps without ``zero_grad``
    is exact as it is; there is no later synchronisation to skip. Without this, Fabric's stock
    warning said the strategy "does not support skipping the gradient synchronization" and to
    remove the call or choose another strategy, which read as if accumulation were not
    supported. Said once per strategy instead, with what does happen."""

    def __init__(self) -> None:
        self.told = False

    def no_backward_sync(self, module: nn.Module, enabled: bool
                         ) -> AbstractContextManager[None]:
        if enabled and not self.told:
            self.told = True
            rank_zero_warn(
                "fabric.no_backward_sync() changes nothing under GeneralParallelFabric: each "
                "fabric.strategy.step reduces its gradients inside the schedule and adds them "
                "to param.grad, so gradient accumulation over several steps (no zero_grad "
                "between them) is exact, but it saves no communication. The call can stay "
                "or go")
        return nullcontext()


class GeneralParallelFabric(CheckpointSettings, DDPStrategy):
    """Run a Fabric training loop with a schedule from one generic scheduler.

    ``Fabric(accelerator="cpu", devices=2, strategy=GeneralParallelFabric("1f1b"))``, or by
    name: ``Fabric(strategy="gsched_1f1b", devices=2)``. The schedule arguments (``schedule``
    to ``fetch_window``, ``schedule="auto"`` with ``memory_budget``), ``step_timeout``,
    ``profile_costs``, ``transport``, ``verify``, ``init_weights``, ``init_weights_prefix`` and
    ``stream_checkpoint``, ``data_loading``, ``tensor_parallel_size`` and
    ``tensor_parallel_plan`` mean what they mean for ``GeneralParallel`` (see docs/usage.md); the
    rest are Fabric DDPStrategy's. Every argument is checked here, before any process starts;
    what needs the device count fails in ``fabric.setup``, on every rank.

    In the loop, :meth:`step` replaces ``loss = loss_fn(model, batch); fabric.backward(loss)``;
    ``fabric.clip_gradients``, ``optimizer.step()``, ``fabric.save`` and ``fabric.load`` work as
    usual (checkpoints hold the full model and optimizer state, written by rank 0; a model
    built without weights is streamed to rank 0 one weight unit at a time, never gathered;
    ``state_dict_type="sharded"``: a directory every rank writes its own stages into).
    :meth:`evaluate` runs a forward-only schedule, and :meth:`finish` gives every rank the full
    model back. One model per strategy.

    Preemption: SIGTERM (and SIGUSR1, unless the program handles it) to any rank is recorded,
    not acted on; every rank learns of it in the same :meth:`step` (its loss exchange carries
    the notice) and :attr:`preempted` becomes True there on every rank, so the loop can save
    and leave together. A :meth:`step` or :meth:`evaluate` after that raises
    :class:`~lightning_gsched.errors.PreemptedError` on every rank.
    """

    def __init__(
        self,
        schedule: Optional[str] = "fslpp",
        R: Optional[int] = None,
        microbatches: Optional[int] = None,
        stages: Optional[int] = None,
        order: Optional[Union[str, Callable[..., Any]]] = None,
        cap: Optional[Union[int, list[int], str]] = "default",
        balance: Union[str, list[int]] = "params",
        leaf_modules: Sequence[Union[str, type]] = (),
        split_points: Optional[list[str]] = None,
        static_shapes: Optional[bool] = None,
        placement: Optional[Callable[..., Any]] = None,
        priority: Optional[Callable[..., Any]] = None,
        step_timeout: float = 300.0,
        forward_cost: Union[float, list[float]] = 1.0,
        backward_cost: Union[float, list[float]] = 2.0,
        weight_cost: Optional[Union[float, list[float]]] = None,
        profile_costs: bool = False,
        split_backward: Optional[bool] = None,
        checkpoint_activations: Union[bool, list[bool]] = False,
        fetch_window: Optional[int] = None,
        data_parallel_size: int = 1,
        data_parallel: Literal["replicate", "shard"] = "replicate",
        data_loading: Literal["per_rank", "per_replica"] = "per_rank",
        tensor_parallel_size: Union[int, list[int], str] = 1,
        tensor_parallel_plan: Optional[Union[dict[str, Any], Callable[..., Any]]] = None,
        memory_budget: Optional[Union[int, str]] = None,
        transport: Literal["auto", "described"] = "auto",
        verify: Union[bool, str] = "auto",
        init_weights: Optional[Union[str, os.PathLike[str]]] = None,
        init_weights_prefix: str = "",
        state_dict_type: Literal["full", "sharded"] = "full",
        stream_checkpoint: Union[bool, str] = "auto",
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        schedule_config, partition_options = pipeline_options(**pipeline_keywords(locals()))
        self.tensor_parallel_plan = tensor_parallel_options(schedule_config,
                                                            tensor_parallel_plan)
        step_timeout = check_launch_arguments(step_timeout, process_group_backend, timeout,
                                              start_method)
        self.transport = check_transport(transport)
        # fabric.save / fabric.load: the engine's checkpoint service (checks stream_checkpoint)
        self._checkpoints = CheckpointService(TorchCheckpointIO, FABRIC, state_dict_type,
                                              stream_checkpoint)
        # a deferred model's kept parameters read from safetensors files (runtime/pretrained.py)
        self.init_weights = (None if init_weights is None
                             else pretrained_weights(init_weights, init_weights_prefix))
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision=precision, process_group_backend=process_group_backend, timeout=timeout,
            start_method=start_method,
        )
        # fabric.no_backward_sync(model): accepted (gradients are reduced inside every step)
        self._backward_sync_control = _ReducedEveryStep()
        self.schedule_config = schedule_config
        self.partition_options = partition_options
        self.step_timeout = step_timeout
        self._engine: PipelineEngine | None = None
        self._optimizers: list[Optimizer] = []
        self._mesh = DeviceMeshSlot()  # engine/mesh.py
        self._preemption = PreemptionNotice()  # installed at launch, in every rank's process
        self._control: ControlGroup | None = None  # barrier, broadcast, the engine's exchanges
        self._exit_report: UncaughtExitReport | None = None  # an uncaught exception, told
        self._steps = 0  # calls of step(): names the step a preemption was agreed in

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDP's, except with tensor parallelism: a worker's T ranks load the same share."""
        return sampler_kwargs(self.world_size, self.global_rank, self.schedule_config)

    @property
    def engine(self) -> PipelineEngine | None:
        """The pipeline of the model set up (None before ``fabric.setup``)."""
        return self._engine

    @property
    def device_mesh(self) -> DeviceMesh:
        """The (pipeline, data_parallel) mesh: shape (W / G, G), rank ``p * G + g``. Made at
        ``fabric.launch`` for a named schedule, at the first :meth:`step` for ``"auto"``;
        before, a StrategyConfigError says so (engine/mesh.py)."""
        return self._mesh.mesh

    @property
    def preempted(self) -> bool:
        """True on every rank from the :meth:`step` (or :meth:`evaluate`) in which every rank
        learnt of a SIGTERM/SIGUSR1 that reached any of them: save and leave the loop then."""
        return bool(self._preemption.agreed)

    @property
    def preemption(self) -> str | None:
        """Which signal reached which rank, agreed in which step (None: no preemption)."""
        if not self._preemption.agreed:
            return None
        return self._preemption.describe(self.global_rank, "every rank stops after it")

    def setup_environment(self) -> None:
        """DDP's process group, the device mesh when G is known (a named schedule), and the
        preemption handlers (SIGTERM, SIGUSR1) in this rank's process."""
        super().setup_environment()
        self._mesh.make_if_decided(self.schedule_config, self.world_size, self.root_device.type)
        self._preemption.install()
        if self.world_size > 1 and self._control is None:
            # the strategy's own collectives wait step_timeout at most, not the launcher's
            # timeout (30 minutes), and stop at once when a rank reports a failure
            self._control = ControlGroup(self.global_rank, self.step_timeout)
            # an exception that ends this process uncaught (the user's loop, or ours) is told
            # to the job, and rank 0's output survives Lightning's child observer
            self._exit_report = UncaughtExitReport(self._control, self._abort_job,
                                                   self._job_failed)
            self._exit_report.install()

    # ------------------------------------------------------------------ setup

    def module_init_context(self, empty_init: Optional[bool] = None
                            ) -> AbstractContextManager[Any]:
        """``fabric.init_module()`` builds the model without weights (parameters on the meta
        device, buffers real), as the Trainer strategy's ``tensor_init_context`` does; each rank
        initialises only the stages it keeps. ``empty_init=False`` builds real weights."""
        if empty_init is False:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(deferred_parameters())
        stack.enter_context(self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """Move what has storage; meta parameters get theirs at the first step."""
        device = self.root_device
        module._apply(  # type: ignore[no-untyped-call]  # nn.Module._apply: unannotated
            lambda t: t if t.is_meta else t.to(device))

    # the model stays unwrapped (DDP's setup_module returns a DistributedDataParallel)
    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        """Keep the model unwrapped; check the schedule for this world size (fails here, on
        every rank, if it does not fit). The plan and the pipeline are made once, at the first
        :meth:`step`."""
        if self._engine is not None and self._engine.module is not module:
            raise StrategyConfigError(
                "GeneralParallelFabric pipelines one model; a second fabric.setup(model) with "
                "another model is not supported (use one strategy, i.e. one Fabric, per model)"
            )
        self._check_precision()
        if self._engine is None:
            self.schedule_config.check(self.world_size)  # a bad config fails here, every rank
            self._engine = PipelineEngine(
                module, self.schedule_config, self.partition_options,
                world_size=self.world_size, rank=self.global_rank, timeout=self.step_timeout,
                transport=self.transport,
                optimizers=lambda: list(self._optimizers), info=rank_zero_info,
                forward_context=self.precision.forward_context,
                device=self.root_device, init_weights=self.init_weights, control=self._control,
                device_mesh=self._mesh, checkpoints=self._checkpoints,
                tensor_parallel_plan=self.tensor_parallel_plan,
            )
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Remember it: its state is kept for the parameters this rank owns only."""
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        return optimizer

    def _check_precision(self) -> None:
        if isinstance(self.precision, MixedPrecision) and self.precision.scaler is not None:
            raise StrategyConfigError(
                "precision='16-mixed' uses a gradient scaler, which GeneralParallelFabric does "
                "not support (gradients are produced inside the schedule); use 'bf16-mixed', "
                "'bf16-true' or '32-true'"
            )

    def _engine_of(self, model: Any) -> PipelineEngine:
        engine = self._engine
        if engine is None:
            raise StrategyConfigError(
                "GeneralParallelFabric was used before fabric.setup(model, optimizer)")
        if _unwrap_objects(model) is not engine.module:
            raise StrategyConfigError(
                "the model passed is not the one set up with fabric.setup(model, ...); pass "
                "that model (or what fabric.setup returned)")
        return engine

    # ------------------------------------------------------------------ steps

    def step(self, model: Any, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
             ) -> torch.Tensor:
        """Forward, backward and gradient hand-over of one optimizer step (collective).

        Args:
            model: the model from ``fabric.setup``.
            batch: this rank's share of the global batch (tensors, or tuples/dicts of tensors,
                with the samples as first dimension); the global batch is the concatenation
                over ranks, cut into the schedule's microbatches.
            loss_fn: ``loss_fn(model, microbatch) -> loss``: calls ``model(...)`` exactly once
                and returns the loss of the microbatch (a mean over its rows, as usual). The
                code before ``model(...)`` runs on two ranks; it must be deterministic.
        Returns:
            The loss of the global batch (the mean over microbatches, as one device computes it
            on the whole global batch), detached, the same on every rank.

        Afterwards ``param.grad`` of every parameter this rank owns holds what it held before
        plus the gradient of that loss, as after ``fabric.backward(loss)``; parameters of stages
        other ranks own have no gradient (their optimizer state stays with their owner).
        """
        engine = self._engine_of(model)
        self._refuse_after_preemption("step")
        self._preemption.install()  # again after a finish(): a new pipeline
        caller = self._caller(engine, model, loss_fn)
        self._steps += 1
        with _inside_fabric_backward():  # precision: around each stage forward (setup_module)
            outcome = engine.training_step(batch, caller, self._pending_signal)
        engine.hand_over_grads(1.0)
        self._agree(outcome.notices, f"step {self._steps}")
        loss: torch.Tensor = outcome.value
        return loss

    def _pending_signal(self) -> int:
        return self._preemption.pending

    def _agree(self, notices: list[int], where: str) -> None:
        """Every rank saw every rank's pending signal in this step's exchange: print it."""
        if self._preemption.agree(notices, where):
            print(self._preemption.describe(  # every rank: the logs show that all stopped
                self.global_rank, "save a checkpoint and leave the loop (fabric.strategy."
                "preempted is True on every rank)"), flush=True)

    def _refuse_after_preemption(self, call: str) -> None:
        if self._preemption.agreed:
            raise PreemptedError(self._preemption.describe(
                self.global_rank, f"fabric.strategy.{call} was called after it. When "
                "fabric.strategy.preempted is True, save (fabric.save) and leave the loop"))

    def evaluate(self, model: Any, batch: Any, fn: Callable[[Any, Any], Any]) -> Any:
        """A forward-only run of the schedule (validation, test, prediction; collective).

        ``fn(model, microbatch)`` calls ``model(...)`` once and returns per-row values:
        tensors (or a structure of tensors) whose first dimension is the microbatch's rows,
        e.g. predictions or ``F.cross_entropy(..., reduction="none")``. Returns them for the
        rows of this rank's ``batch``, in order. Batches may have any size. Call
        ``model.eval()``/``model.train()`` around it as you would without a pipeline.
        """
        engine = self._engine_of(model)
        self._refuse_after_preemption("evaluate")
        self._preemption.install()
        outcome = engine.eval_step(batch, self._caller(engine, model, fn),
                                   keep_outputs="predictions", notice=self._pending_signal)
        self._agree(outcome.notices, f"an evaluation after step {self._steps}")
        return outcome.value

    @staticmethod
    def _caller(engine: PipelineEngine, model: Any, fn: Callable[[Any, Any], Any]) -> StepCaller:
        name = getattr(fn, "__name__", type(fn).__name__)
        return StepCaller(engine.module, lambda micro: fn(model, micro), name, who="model",
                          record_logs=False)

    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any,
                 **kwargs: Any) -> None:
        raise StrategyConfigError(
            "GeneralParallelFabric runs the backward inside fabric.strategy.step(model, batch, "
            "loss_fn) (a schedule interleaves the forwards and backwards of microbatches over "
            "the ranks); call that instead of model(...) + fabric.backward(loss)"
        )

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer,
                            max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        """Clip by the norm of the whole model, each parameter counted once over all ranks."""
        if self._engine is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type,
                                               error_if_nonfinite)
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        return self._engine.clip_grad_norm(params, float(max_norm), float(norm_type),
                                           error_if_nonfinite)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Over the strategy's control group: bounded by step_timeout, and released at once
        when a rank reports a failure (e.g. a failed ``fabric.save``, which ends in a barrier)."""
        control = self._control
        if control is None or control.closed:
            return super().barrier(*args, **kwargs)
        control.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        control = self._control
        if control is None or control.closed:
            return super().broadcast(obj, src)
        return control.broadcast_object(obj, src)

    def all_reduce(self, tensor: Any, group: Optional[Any] = None,
                   reduce_op: Optional[Any] = "mean") -> Any:
        """Lightning's, except that a mean over one of our groups (the device mesh's, on a
        gloo job) is asked for as a sum and divided (runtime/gloo_groups says why)."""
        return lightning_reduce(super().all_reduce, tensor, group, reduce_op)

    def _failed(self, where: str, exc: BaseException) -> None:
        """This rank failed in a collective call: tell the job and drop the connections, so
        peers waiting on this rank stop at once with an error naming it."""
        self._abort_job(f"rank {self.global_rank} failed in {where}: {error_text(exc)}")

    def _abort_job(self, message: str) -> None:
        if self._engine is not None:
            self._engine.abort(message)
        elif self._control is not None:
            self._control.abort(message)

    # ------------------------------------------------------------------ checkpoints
    # Fabric's save/load hooks, each translated into calls on the engine's checkpoint service
    # (the Trainer strategy's hooks make the same calls): it decides gathered or streamed,
    # written here (atomically) or by a user's CheckpointIO, checked on every rank, set aside
    # for a model built without weights

    def _view(self) -> CheckpointView:
        engine = self._engine
        return CheckpointView(engine.module if engine is not None else None, engine,
                              list(self._optimizers), self.global_rank, self.world_size,
                              self.checkpoint_io, self.step_timeout)

    def _pipelines(self, module: Any) -> bool:
        return self._engine is not None and module is self._engine.module

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The pipelined model's full state dict: gathered to rank 0 from the stages' owners
        (collective), or, during a streamed save, described with placeholders."""
        if not self._pipelines(module):
            return module.state_dict()
        return self._checkpoints.model_state(self._view(), module.state_dict)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every parameter's optimizer state, gathered to rank 0 (collective); during a
        streamed save, described with placeholders (one gather of small descriptions)."""
        return self._checkpoints.optimizer_state(self._view(), optimizer)

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any],
                               strict: bool = True) -> None:
        if not self._pipelines(module):
            module.load_state_dict(state_dict, strict=strict)
            return
        self._checkpoints.load_model_state(self._view(), state_dict, strict)

    def save_checkpoint(self, path: _PATH, state: dict[str, Any],
                        storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Fabric's conversion of ``state`` (in the user's key order) inside one save of the
        checkpoint service, which decides: gathered on every rank (collective) and written by
        rank 0 to a temporary name next to ``path`` renamed over it (readers see the old file
        or the whole new one), or, for a model built without weights
        (``stream_checkpoint="auto"``, or ``True`` for any model) when the model is among
        ``state``'s entries, described first and streamed to rank 0 one weight unit (one
        optimizer tensor) at a time, written as it arrives. A user's CheckpointIO or a remote
        path gets the real checkpoint, written by rank 0. ``state_dict_type="sharded"``: every
        rank writes the stages it first owns into one torch.distributed.checkpoint directory,
        which records which of ``state``'s keys held the model and the optimizers."""
        view = self._view()

        def hand_on(checkpoint: dict[str, Any]) -> None:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint=checkpoint, path=path,
                                                   storage_options=storage_options)

        # which of the user's keys hold the model and the optimizers (a sharded directory
        # records them; engine/checkpoint_sharded.py, "Fabric's keys")
        model_key = next((key for key, obj in state.items() if self._pipelines(obj)), None)
        optimizer_keys = [key for key, obj in state.items() if isinstance(obj, Optimizer)]
        try:
            with self._checkpoints.saving(view, includes_model=model_key is not None):
                converted = self._convert_stateful_objects_in_state(state, filter=filter or {})
            self._checkpoints.write(view, converted, path, storage_options, hand_on,
                                    entries=(model_key, optimizer_keys))
        except Exception as exc:
            # the peers are on their way to fabric.save's barrier (or in the gather): they
            # stop at once, naming this rank, instead of waiting for it
            self._failed(f"fabric.save({str(path)!r})", exc)
            raise

    def load_checkpoint(self, path: _PATH, state: Any = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read by the checkpoint service on every rank (a missing, truncated or foreign local
        file raises the same CheckpointError on every rank), restored as Fabric restores it,
        then each rank drops the optimizer state of parameters it does not own.

        Into a model built without weights (``fabric.init_module()``) whose pipeline is not
        built yet, a copy would be a no-op on its meta parameters: the file is memory-mapped
        instead, and the model's and optimizers' entries are applied at the build, each rank
        only to what it keeps (as the Trainer strategy does)."""
        view, io = self._view(), self.checkpoint_io
        checkpoint = self._checkpoints.read(
            view, path, weights_only, lambda: io.load_checkpoint(path, weights_only=weights_only),
            fabric_state=state, strict=strict)
        if view.deferred and isinstance(state, dict):
            return self._load_deferred(view, path, checkpoint, state, strict)
        if isinstance(state, dict):  # Fabric loads optimizers itself: their state as they take it
            for name, obj in state.items():
                optimizer = _unwrap_objects(obj)
                if optimizer in self._optimizers and isinstance(checkpoint.get(name), dict):
                    checkpoint[name] = self._checkpoints.local_optimizer_state(
                        view, optimizer, checkpoint[name])
        self.checkpoint_io = _Preloaded(checkpoint)  # type: ignore[assignment]
        try:  # Fabric restores what was read and checked, without reading it again
            remainder = super().load_checkpoint(path, state, strict=strict,
                                                weights_only=weights_only)
        finally:
            self.checkpoint_io = io
        self._checkpoints.prune(view)
        return remainder

    def _load_deferred(self, view: CheckpointView, path: _PATH, checkpoint: dict[str, Any],
                       state: dict[str, Any], strict: bool) -> dict[str, Any]:
        """:meth:`load_checkpoint` into a deferred model: the model's and optimizers' entries
        handed to the checkpoint service (set aside for the build), the rest as Fabric would."""
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
        by_object = {id(_unwrap_objects(obj)): name for name, obj in state.items()}
        model_key = by_object.get(id(view.module))
        if model_key is None or model_key not in checkpoint:
            raise StrategyConfigError(
                f"fabric.load({str(path)!r}, state) into a model built without weights needs "
                "the model in state, under the key it was saved with (e.g. {'model': model, "
                "'optimizer': optimizer}); its weights exist only once the checkpoint is applied")
        self._checkpoints.load_model_state(view, checkpoint[model_key], strict)
        keys = [by_object.get(id(optimizer)) for optimizer in self._optimizers]
        self._checkpoints.load_optimizer_states(
            view, [checkpoint.get(key) if key is not None else None for key in keys])
        applied = {model_key} | {key for key in keys if key is not None}
        for name, obj in state.items():
            if name in applied or name not in checkpoint:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(name))
            else:
                state[name] = checkpoint.pop(name)
        return {k: v for k, v in checkpoint.items() if k not in applied}

    # ------------------------------------------------------------------ end

    def finish(self) -> None:
        """End the pipeline (collective): every rank gets the full weights and optimizer state
        back (unless a rank failed) and the pipeline's process groups are released.

        Afterwards the model is an ordinary full model on every rank, SIGTERM and SIGUSR1 act
        as they did before ``fabric.launch()``, and a later :meth:`step` builds a new pipeline.
        """
        if self._engine is not None:
            self._engine.close(gather=True)
        self._preemption.uninstall()  # no pipeline left to stop together: signals act as usual

    def _job_failed(self) -> bool:
        """A failure is already known to the job (this rank's or a peer's)."""
        return ((self._engine is not None and self._engine.failed)
                or (self._control is not None and self._control.failed))

    def teardown(self) -> None:
        self.finish()
        if self._exit_report is not None:
            self._exit_report.uninstall()
            self._exit_report = None
        if self._control is not None:
            self._control.close()
            self._control = None
        self._mesh.release()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, schedule in library_names("GeneralParallelFabric"):
            strategy_registry.register(name, cls, description=description, schedule=schedule)


@contextmanager
def _inside_fabric_backward() -> Iterator[None]:
    """What ``fabric.backward`` declares around its backward: the model's outputs carry hooks
    that refuse a backward outside it, and :meth:`GeneralParallelFabric.step` is that backward."""
    before = fabric_wrappers._in_fabric_backward
    fabric_wrappers._in_fabric_backward = True
    try:
        yield
    finally:
        fabric_wrappers._in_fabric_backward = before


class _Preloaded:
    """A CheckpointIO stand-in whose ``load_checkpoint`` returns what was already read and
    checked, so Fabric's own ``load_checkpoint`` restores it without reading it again."""

    def __init__(self, checkpoint: Any) -> None:
        self.checkpoint = checkpoint

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint
