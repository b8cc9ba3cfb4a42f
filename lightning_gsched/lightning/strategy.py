"""``GeneralParallel``: every library schedule (or your own) as a Lightning strategy.

Why a DDPStrategy subclass: launching (script re-run or spawn/fork), process-group setup,
cluster environments (torchrun, SLURM), ``is_distributed`` and the distributed sampler are
exactly DDP's; what differs is that the model is not wrapped. Instead each step runs the planned
programs (the engine, :mod:`lightning_gsched.engine`): ``training_step`` runs the whole schedule and keeps the gradients
aside, ``backward`` hands them to the parameters (Lightning zeroes gradients between the two),
clipping by norm is global over all stages, evaluation runs forward-only programs, and
checkpoints go through the engine's checkpoint service (``CheckpointService``: the checkpoint
hooks here only translate Lightning's calls into its). The engine, its checkpoint service and
the runtime facade are shared with the Fabric strategy (``lightning_gsched.fabric``).
"""

from __future__ import annotations

import functools
import os
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_gsched.engine import (
    TRAINER,
    CheckpointService,
    CheckpointSettings,
    CheckpointView,
    ControlGroup,
    DeviceMeshSlot,
    MemoryReport,
    PipelineEngine,
    StepCaller,
    check_launch_arguments,
    check_transport,
    library_names,
    pipeline_keywords,
    pipeline_options,
    replay,
    sampler_kwargs,
    tensor_parallel_options,
)
from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.lightning.hook_failure import FailureNotice, failure_message
from lightning_gsched.lightning.outputs_read import outputs_read
from lightning_gsched.lightning.preemption import PreemptionSignals
from lightning_gsched.lightning.setup_checks import check_supported
from lightning_gsched.lightning.zero_grad_ahead import loop_zeroes_grads
from lightning_gsched.runtime import (
    deferred_parameters,
    lightning_reduce,
    pretrained_weights,
)
from lightning_gsched.schedule import validate


class GeneralParallel(CheckpointSettings, DDPStrategy):
    """Train any Lightning project with a schedule from one generic scheduler.

    Args:
        schedule: a library name (ddp, fsdp, gpipe, 1f1b, lpp, interleaved, fslpp, fslpp-seed,
            zb-h1, zb-h2, zbv, v-half, v-min), ``"auto"`` (the tuner profiles the model at the first batch and
            picks the fastest schedule, S, B, R and checkpointing; see ``memory_budget``), or a
            label for a custom ``placement``.
        R: workers per loop for the looped schedules (lpp, interleaved, fslpp, fslpp-seed).
        microbatches: B, the number of pieces the global batch is cut into per step; default
            the schedule's (2W for pipelines, W for ddp/fsdp).
        stages: S, the number of stages the model's forward is cut into; default the schedule's.
        order: priority order name (bfs, 1f1b, interleaved) or a callable ``n(s, b, d)``.
        cap: (stage, microbatch) stashes per worker, as in ``plan()`` and ``gsched plan --cap``:
            ``"default"`` (the schedule's), an int, a list per worker, ``"auto"`` (smallest cap
            that keeps the latency), ``None`` or ``"none"`` (uncapped).
        balance: how to cut stages: ``"params"``, ``"time"`` (profiled on rank 0) or a list of
            unit counts per stage.
        leaf_modules: module class names or FQNs the tracer keeps whole.
        split_points: S-1 module FQNs to cut before, instead of balancing.
        static_shapes: passed to the partitioner (see docs/partition.md).
        verify: compare the split with the unsplit model on the first microbatch (outputs and
            gradients) before training: ``"auto"`` (models with real weights up to 1 GiB),
            ``True`` or ``False``; a difference fails setup with ``SplitMismatchError``.
        state_dict_type: ``"full"`` (one ``.ckpt`` written by rank 0, loads anywhere) or
            ``"sharded"`` (a torch.distributed.checkpoint directory, each rank writes its part).
        placement, priority: a custom schedule as two callables ``w(s, b, d)``, ``n(s, b, d)``.
        step_timeout: seconds any one wait inside a step may take before every rank fails.
        gather_on_teardown: give every rank the full trained weights when the run ends, so the
            module is usable afterwards as after DDP (costs one broadcast of the model).
            ``"auto"`` (default): yes, unless the model was built without weights
            (``configure_model``, ``init_module``: deferred initialisation), which must never
            become whole on a rank unasked; ``True``/``False``: always/never.
        init_weights: start a model built without weights (``configure_model``,
            ``init_module``) from pretrained safetensors weights, as ``transformers`` saves them:
            a ``model.safetensors`` file, a ``model.safetensors.index.json`` (shards), or a
            directory holding one. Each rank reads only the tensors of the parameters it keeps
            (docs/memory.md, "Models larger than one rank"). None: initialise them.
        init_weights_prefix: what the model's ``state_dict`` names carry before the file's,
            e.g. ``"model."`` for a LightningModule holding the saved network as ``self.model``.
        forward_cost, backward_cost: per-stage costs the planner uses for its timeline.
        weight_cost: the W phase's per-stage cost (zero-bubble schedules; ``backward_cost`` is
            then B's); default: half of ``backward_cost``, the other half going to B.
        profile_costs: plan with the stages' own seconds instead of the cost arguments: at the
            first batch rank 0 times each stage's forward and backward (B and W apart for a
            split backward) on the first microbatch and every rank plans with its figures.
            The order of jobs can then follow stages that differ (a first stage fed token ids
            has a free B and a long W); models built with weights only. ``"auto"`` always
            does this.
        split_backward: run backwards as B then W (None: the schedule's choice, True for
            zb-h1, zb-h2, zbv, v-half, v-min).
        checkpoint_activations: activation checkpointing, True for every stage or one bool per
            stage: a checkpointed stage's forward keeps only its inputs (and the random
            generators' state) and its backward runs the forward again first, trading one more
            forward per backward (charged to the planner's backward cost) for the stashed
            activations.
        fetch_window: the most fetched (non-owned) stages a worker holds at once (fsdp,
            fslpp): None (each fetch one compute early: at most 2) or 1 (a fetch waits for
            the previous fetched stage's release; less memory, the transfer is not hidden).
        data_parallel_size: G replicas of the schedule, each on W / G ranks (pipeline x data
            parallel; rank ``p * G + g`` is pipeline position p of replica g, and
            ``self.device_mesh`` has the dimensions ``"pipeline"`` and ``"data_parallel"``).
            The schedule's defaults are those of W / G workers; ``microbatches`` counts one
            replica's. Not with ddp or fsdp, which are data parallel already.
        data_parallel: ``"replicate"`` (each replica holds its stages; one gradient
            all-reduce per stage, issued after its last backward) or ``"shard"`` (each stage
            owned once across the replicas, fetched once per step, its gradient reduced to the
            owner).
        data_loading: who loads which rows. ``"per_rank"`` (DDP's): each rank (each
            tensor-parallel worker) loads its own share, a replica's batch is its ranks'
            batches joined, and each step moves the rows a rank reads but did not load.
            ``"per_replica"`` (torchtitan's): every rank of a data-parallel replica loads the
            replica's whole batch (``distributed_sampler_kwargs`` deal G shares), so a step
            starts without asking any rank anything; the ranks' batches are checked to agree
            with the step's losses. The global batch is then G x ``batch_size``. With
            ``schedule="auto"`` only for a fixed ``data_parallel_size`` (2 or more) and T
            (docs/usage.md, "Who loads which rows").
        tensor_parallel_size: T ranks per pipeline worker, sharing each of its stages' layers
            (W = P x G x T; rank ``(p * G + g) * T + t``, so a worker's ranks are consecutive
            and ``self.device_mesh`` gains an innermost ``"tensor_parallel"`` dimension). The
            schedule's defaults are those of W / T workers; a worker's T ranks load the same
            rows (``distributed_sampler_kwargs``). With ``schedule="auto"`` a T given is kept
            and the tuner profiles the stages sharded; a list of T values (e.g. ``[1, 2, 4]``)
            or ``"auto"`` (those of 1, 2, 4, 8 dividing W) is searched, the fastest fitting
            pick over all of them running, and every rank then loads its own rows whatever T
            is picked (docs/tensor_parallel.md).
        tensor_parallel_plan: how each stage is sharded over ``mesh["tensor_parallel"]``
            (required when T > 1): module-name patterns to torch's tensor-parallel styles, as
            ``parallelize_module`` takes them (``{"blocks.*.attn.qkv": ColwiseParallel(), ...}``;
            by name in a YAML config: ``"colwise"``, ``"rowwise"``, ``"sequence"`` and the
            sequence-parallel names of docs/tensor_parallel.md), or a
            function ``parallelize(stage_module, tp_mesh)``. Stages keep the model's module
            names, so one plan serves every stage (docs/tensor_parallel.md).
        memory_budget: bytes per rank (an int, or a string such as ``"20GiB"``) the plan
            ``"auto"`` picks must fit in its predicted peak; only with ``schedule="auto"``.
            None: the fastest plan, whatever its bytes. With ``"auto"``, ``stages``,
            ``microbatches``, ``R`` and ``checkpoint_activations=True`` restrict the search;
            ``order``, ``cap``, ``placement``, ``priority``, costs and ``fetch_window`` are
            refused (they would decide what "auto" chooses).
        transport: how activations and input-gradients travel between ranks: ``"auto"``
            (their shapes are exchanged at the first step of each batch shape, then bare
            tensors) or ``"described"`` (every message carries its shapes; for a model whose
            stage outputs change shape with the data, not only with the batch's shape).
        Remaining arguments are DDPStrategy's (process_group_backend, timeout, start_method...).

    Every argument is checked here, before any process starts, and a wrong one raises a
    ``GschedError`` subclass naming it; what needs the device count (R dividing it, S and B
    multiples a placement requires, a cap list's length) fails at setup on every rank.
    """

    strategy_name = "gsched"

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
        state_dict_type: Literal["full", "sharded"] = "full",
        placement: Optional[Callable[..., Any]] = None,
        priority: Optional[Callable[..., Any]] = None,
        step_timeout: float = 300.0,
        gather_on_teardown: Union[bool, str] = "auto",
        stream_checkpoint: Union[bool, str] = "auto",
        init_weights: Optional[Union[str, os.PathLike[str]]] = None,
        init_weights_prefix: str = "",
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
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        # every argument is checked here, before Lightning starts any process (see docs/usage.md)
        schedule_config, partition_options = pipeline_options(**pipeline_keywords(locals()))
        self.tensor_parallel_plan = tensor_parallel_options(schedule_config,
                                                            tensor_parallel_plan)
        # the checkpoint hooks' arguments (checked) and state: the engine's checkpoint service
        checkpoints = CheckpointService(TorchCheckpointIO, TRAINER, state_dict_type,
                                        stream_checkpoint)
        if gather_on_teardown != "auto":
            validate.flag("gather_on_teardown", gather_on_teardown, StrategyConfigError)
        self.init_weights = (None if init_weights is None
                             else pretrained_weights(init_weights, init_weights_prefix))
        step_timeout = check_launch_arguments(step_timeout, process_group_backend, timeout,
                                              start_method)
        self.transport = check_transport(transport)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method,
        )
        self.schedule_config = schedule_config
        self.partition_options = partition_options
        self._checkpoints = checkpoints
        self.step_timeout = step_timeout
        self.gather_on_teardown = gather_on_teardown
        self._engine: PipelineEngine | None = None
        self._control: ControlGroup | None = None  # this run's own collectives (.control)
        self._signals: PreemptionSignals | None = None  # SIGTERM/SIGUSR1 (.preemption)
        self._notice: FailureNotice | None = None
        self._failure: str | None = None  # "rank r failed in <hook>: ..." once reported
        self._failed = False
        # the module of a run that ended without giving every rank the full weights back
        self._released: weakref.ref[Any] | None = None
        # the last run's predicted and measured bytes per rank (kept after teardown)
        self.memory_report: MemoryReport | None = None
        self._mesh = DeviceMeshSlot(on_made=self._give_module_mesh)  # engine/mesh.py

    # ------------------------------------------------------------------ properties

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDP's, except with tensor parallelism: a worker's T ranks load the same share."""
        return sampler_kwargs(self.world_size, self.global_rank, self.schedule_config)

    @property
    def is_distributed(self) -> bool:
        """Lightning enables ``sync_dist`` and the distributed sampler only when this is True."""
        return True

    @property
    def engine(self) -> PipelineEngine | None:
        """The running pipeline (None before setup and after teardown)."""
        return self._engine

    @property
    def device_mesh(self) -> DeviceMesh:
        """The (pipeline, data_parallel) mesh: shape (W / G, G), rank ``p * G + g``, as
        ``self.device_mesh`` in the LightningModule (ModelParallelStrategy's attribute).
        Made at setup for a named schedule, at the first batch for ``"auto"``; before, a
        StrategyConfigError says so (engine/mesh.py)."""
        return self._mesh.mesh

    # ------------------------------------------------------------------ setup

    def setup_environment(self) -> None:
        """DDP's process group, the run's fault handling, then the device mesh when G is known
        (a named schedule): ``configure_model`` can read ``self.device_mesh`` as under
        ModelParallelStrategy. Why the fault handling this early: Lightning runs the module's
        ``setup`` hook between two barriers, then ``configure_model`` and
        ``configure_optimizers``, all before :meth:`setup`; a rank failing there must be named
        to its peers, and a peer waiting in those barriers bounded by ``step_timeout``."""
        super().setup_environment()
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            self._install_fault_handling(module._trainer)
        self._mesh.make_if_decided(self.schedule_config, self.world_size, self.root_device.type)

    def _give_module_mesh(self, mesh: DeviceMesh) -> None:
        """``LightningModule.device_mesh`` reads ``_device_mesh``; Lightning's own strategies
        set it so (ModelParallelStrategy.setup_environment)."""
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = mesh

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        check_supported(module, trainer, trainer.state.fn == TrainerFn.FITTING,
                        self._layer_sync is not None)
        self._check_precision()
        if self._is_released(module) and self._checkpoints.restore is None:
            raise StrategyConfigError(
                "the previous run ended without gathering the weights (gather_on_teardown=False; "
                "the default 'auto' for a model built without weights; or a failure), so the "
                "module is incomplete on this rank. Pass ckpt_path= (e.g. trainer.validate("
                "model, ckpt_path='last')): each rank then restores its own stages from it; or "
                "build a new model"
            )
        self._failed = False
        self.schedule_config.check(self.world_size)  # a bad config fails here, on every rank
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self._notice is None:  # setup_environment had no trainer to install it for
            self._install_fault_handling(trainer)
        self._engine = PipelineEngine(
            module, self.schedule_config, self.partition_options,
            world_size=self.world_size, rank=self.global_rank, timeout=self.step_timeout,
            transport=self.transport,
            optimizers=lambda: [_unwrap(o) for o in self.optimizers], info=rank_zero_info,
            control=self._control, device=self.root_device, init_weights=self.init_weights,
            device_mesh=self._mesh, checkpoints=self._checkpoints,
            tensor_parallel_plan=self.tensor_parallel_plan,
        )
        # clipping by the global norm over every rank's stages, for this strategy's plugin
        self.precision_plugin.clip_grad_by_norm = (  # type: ignore[method-assign]
            self._clip_grad_by_norm)

    def _install_fault_handling(self, trainer: Any) -> None:
        """The run's control group, the preemption signals, the failure notice (see
        docs/runtime.md, "Faults"). Runs before the Trainer registers its signal handlers."""
        self._failure = None
        if self.world_size > 1:
            self._control = ControlGroup(self.global_rank, self.step_timeout)
        self._signals = PreemptionSignals(trainer)
        trainer._signal_connector = self._signals
        self._signals.register_signal_handlers()  # a signal during setup is a notice too
        self._notice = FailureNotice(self._report_failure)
        _callbacks(trainer).insert(0, self._notice)

    def _report_failure(self, exception: BaseException) -> None:
        """First of the ``on_exception`` calls: a preemption is a planned stop (every rank is
        at the same boundary, the collective saves of other callbacks can run); anything else
        is a failure that every peer must learn of now."""
        if isinstance(exception, SIGTERMException) and self._signals and self._signals.agreed:
            return
        self._failure = failure_message(self.global_rank, exception)
        # the ranks stopped at different points: no consistent state to save, and a save
        # would also rotate out the last good checkpoint (save_top_k); the others stay intact
        assert self.lightning_module is not None  # an exception in a running Trainer
        for callback in _callbacks(self.lightning_module.trainer):
            if isinstance(callback, ModelCheckpoint) and callback.save_on_exception:
                callback.save_on_exception = False
        if self._engine is not None:
            self._engine.abort(self._failure)
        elif self._control is not None:
            self._control.abort(self._failure)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        """``configure_model()`` and ``trainer.init_module()`` build the model without weights
        (parameters on the meta device, buffers real); each rank gives storage to and
        initialises only the stages it keeps, at the first batch (docs/memory.md, "Models
        larger than one rank"). ``init_module(empty_init=False)`` builds real weights."""
        if empty_init is False:
            with super().tensor_init_context(empty_init):
                yield
            return
        with deferred_parameters(), self.root_device, \
                self.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self) -> None:
        """Move what has storage; a deferred model's parameters stay on meta until the first
        batch gives this rank's their storage on the device."""
        assert self.model is not None
        device = self.root_device
        # nn.Module._apply has no annotations
        self.model._apply(  # type: ignore[no-untyped-call]
            lambda t: t if t.is_meta else t.to(device))

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            raise StrategyConfigError(
                "precision='16-mixed' uses a gradient scaler, which GeneralParallel does not "
                "support (gradients are produced inside the schedule); use 'bf16-mixed' or '32'"
            )

    # ------------------------------------------------------------------ steps

    def _is_released(self, module: Any) -> bool:
        """Whether ``module`` is the one a run ended with, its weights not gathered."""
        return self._released is not None and module is not None and self._released() is module

    def _require_engine(self) -> PipelineEngine:
        if self._engine is None:
            raise StrategyConfigError("GeneralParallel was used before Trainer setup")
        return self._engine

    def _caller(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepCaller:
        """The user's ``<hook>(batch, *rest, **kwargs)`` with ``self(...)`` intercepted."""
        module = self.lightning_module
        assert module is not None
        return StepCaller.for_hook(module, hook, tuple(args[1:]), kwargs)

    def _logged(self, outcome: Any) -> Any:
        """Log what the step logged (reduced over the global batch) on every rank; its value."""
        replay(self.lightning_module, outcome.logged, self._require_engine().device,
               outcome.rows)
        return outcome.value

    def _pending_signal(self) -> int:
        return self._signals.pending if self._signals is not None else 0

    def _agree(self, outcome: Any, where: str) -> None:
        """Every rank saw every rank's pending signal in this step's exchange: stop together."""
        if self._signals is not None:
            self._signals.agree(outcome.notices, where)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._require_engine()
        with self.precision_plugin.train_step_context():
            caller = self._caller("training_step", args, kwargs)
            assert self.lightning_module is not None
            trainer = self.lightning_module.trainer
            outcome = engine.training_step(
                args[0], caller, self._pending_signal,
                drop_previous_grads=loop_zeroes_grads(trainer, self.lightning_module),
                keep_extras=outputs_read(self.lightning_module, "training_step"))
            self._agree(outcome, f"training step {trainer.global_step + 1}")
            loss = self._logged(outcome)
            # Lightning hands the dict's other keys to on_train_batch_end (outputs_read.py)
            return loss if outcome.extras is None else {**outcome.extras, "loss": loss}

    def _eval_step(self, hook: str, context: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        engine = self._require_engine()
        with context:
            caller = self._caller(hook, args, kwargs)
            assert self.lightning_module is not None
            keep: Literal["predictions", "hooks"] | None = (
                "predictions" if hook == "predict_step"
                else "hooks" if outputs_read(self.lightning_module, hook) else None)
            outcome = engine.eval_step(args[0], caller, keep_outputs=keep,
                                       notice=self._pending_signal)
            self._agree(outcome, f"a {hook.split('_')[0]} step")
            return self._logged(outcome)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context(),
                               args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context(),
                               args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context(),
                               args, kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Hand the schedule's gradients to the parameters (the autograd work already ran)."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._require_engine().hand_over_grads(1.0 / module.trainer.accumulate_grad_batches)
        return self.precision_plugin.post_backward(closure_loss, module)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = list(self.precision_plugin.main_params(optimizer))
        self._require_engine().clip_grad_norm(params, float(clip_val))

    # ------------------------------------------------------------------ collectives

    def barrier(self, name: Optional[str] = None) -> None:
        """Over the run's control group once set up: bounded by step_timeout, and released at
        once when a rank fails (Lightning's own uses the default group, see .control)."""
        control = self._control
        if control is None or control.closed:
            return super().barrier(name)
        control.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        control = self._control
        if control is None or control.closed:
            return super().broadcast(obj, src)
        return control.broadcast_object(obj, src)

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        """Over the run's control group unless ``group`` is given; a mean over one of our
        groups is asked of Lightning as a sum and divided (runtime/gloo_groups says why)."""
        reduce = super().reduce
        control = self._control
        if group is not None or control is None or control.closed:
            return lightning_reduce(reduce, tensor, group, reduce_op)
        return control.run("a reduce (self.log sync_dist)",
                           lambda: lightning_reduce(reduce, tensor, control.group, reduce_op))

    # ------------------------------------------------------------------ checkpoints
    # Lightning calls these names on the strategy; each is one call on the engine's
    # checkpoint service, which decides how the checkpoint is saved or loaded

    def _view(self) -> CheckpointView:
        """What the checkpoint service reads of this strategy now."""
        return CheckpointView(self.lightning_module, self._engine,
                              [_unwrap(o) for o in self.optimizers], self.global_rank,
                              self.world_size, self.checkpoint_io, self.step_timeout,
                              self._failure, self._is_released(self.lightning_module))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        view = self._view()  # a save begins here (Lightning's dump_checkpoint)
        with self._checkpoints.saving(view):
            return self._checkpoints.model_state(view, super().lightning_module_state_dict)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(self._view(), _unwrap(optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        hand_on = functools.partial(super().save_checkpoint, filepath=filepath,
                                    storage_options=storage_options)
        self._checkpoints.write(self._view(), checkpoint, filepath, storage_options, hand_on)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None
                        ) -> dict[str, Any]:
        read = functools.partial(super().load_checkpoint, checkpoint_path, weights_only=weights_only)
        return self._checkpoints.read(self._view(), checkpoint_path, weights_only, read)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_model_state(self._view(), checkpoint["state_dict"], strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizer_states(self._view(), checkpoint["optimizer_states"])
        _optimizers_to_device(self.optimizers, self.root_device)

    # ------------------------------------------------------------------ end

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        if self._engine is not None:
            self._engine.failed = True
        signals = self._signals
        if isinstance(exception, SIGTERMException) and signals is not None and signals.agreed:
            print(signals.describe(self.global_rank), flush=True)
            signals.requeue_if_asked()
        elif self._failure is not None and self._failure.startswith(f"rank {self.global_rank} "):
            print(self._failure, flush=True)
        super().on_exception(exception)

    def teardown(self) -> None:
        if self._engine is not None:
            wanted = self.gather_on_teardown
            if wanted == "auto":  # a model built without weights never becomes whole unasked
                wanted = not self._engine.deferred
            gather = bool(wanted) and not self._failed
            released = self._engine.built and not gather
            self._released = (weakref.ref(self.lightning_module)
                              if released and self.lightning_module is not None else None)
            self._engine.close(gather=gather)
            self.memory_report = self._engine.memory
            self._engine = None
        self._checkpoints.restore = None
        if self._control is not None:
            self._control.close()
            if self._failure is not None and self.global_rank == 0:
                # rank 0 hosts the job's store; a SIGTERM (the launcher ending the group)
                self._control.linger(self.world_size - 1, stop=lambda: self._pending_signal() > 0)
            if self._failed:
                self._control.outlive_host()
            self._control = None
        self._mesh.release()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (self._notice is not None and trainer is not None
                and self._notice in _callbacks(trainer)):
            _callbacks(trainer).remove(self._notice)
        self._notice = None
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            # a deferred model keeps other ranks' parameters on meta, which .cpu() cannot move
            module._apply(  # type: ignore[no-untyped-call]  # nn.Module._apply: unannotated
                lambda t: t if t.is_meta else t.cpu())
            module.cpu = lambda: module  # type: ignore[method-assign]
            try:
                super().teardown()
            finally:
                del module.cpu
            return
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, schedule in library_names("GeneralParallel"):
            strategy_registry.register(name, cls, description=description, schedule=schedule)


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _callbacks(trainer: Trainer) -> list[Callback]:
    """``trainer.callbacks``: set by Lightning's callback connector, not declared on Trainer."""
    return trainer.callbacks  # type: ignore[attr-defined,no-any-return]
