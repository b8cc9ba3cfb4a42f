"""An engine's state and its build at the first batch: probe, choose, partition, plan, weights.

Why a module of its own: the build runs once per pipeline and is most of what an engine
decides (the step contract checked, ``"auto"``'s pick, the partition and its ties, the costs, the
training plan, the device mesh, each rank's weights and shards, the memory prediction, the
runtime started); the steps (:mod:`.engine`) run the runtime it leaves, every batch.
:class:`PipelineBuild` holds the state both read and is the base of
:class:`~lightning_gsched.engine.engine.PipelineEngine`; the order of the phases is in
:meth:`PipelineBuild.build`. It imports nothing of Lightning, as the engine does not.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from lightning_gsched.engine import whole_call
from lightning_gsched.engine.auto import (
    TensorParallelTuning,
    choose_schedule,
    probe_parts,
    step_loss_fn,
)
from lightning_gsched.engine.checkpoint import CheckpointService
from lightning_gsched.engine.config import ScheduleConfig
from lightning_gsched.engine.control import ControlGroup
from lightning_gsched.engine.cut import cut_model
from lightning_gsched.engine.intercept import CallArgs, StepCaller, step_loss
from lightning_gsched.engine.logsync import LossLogExchange
from lightning_gsched.engine.memory_report import MemoryReport
from lightning_gsched.engine.mesh import TENSOR_PARALLEL, DeviceMeshSlot
from lightning_gsched.engine.options import PartitionOptions
from lightning_gsched.engine.profiled_costs import costs_text, profiled_costs
from lightning_gsched.engine.startup import startup_rows, startup_text
from lightning_gsched.engine.step_rows import Held, StepRows
from lightning_gsched.engine.values import normal_call
from lightning_gsched.engine.weights import (
    agreed_seed,
    materialize,
    pieces_of,
    shard_stages,
    sync_module_states,
)
from lightning_gsched.engine.workers import Workers
from lightning_gsched.errors import RuntimeFault, StrategyConfigError
from lightning_gsched.measure.build_passes import BuildPasses
from lightning_gsched.partition import Partition, TooManyStagesError
from lightning_gsched.partition.checkpoint_calls import reentrant_checkpoints
from lightning_gsched.partition.checkpoint_calls import split_backward_refusal as reentrant_refusal
from lightning_gsched.partition.compiled import (
    DonationOff,
    compiled_modules,
    donation_line,
    split_backward_refusal,
    tensor_parallel_refusal,
)
from lightning_gsched.partition.preserve import preserved_tensors_and_rng, python_state_kept
from lightning_gsched.partition.tensor_parallel import (
    TensorParallelPlan,
    TensorParallelPlanError,
    kept_holders,
    too_few_units,
    with_kept_whole,
)
from lightning_gsched.partition.tensor_parallel_state import shard_optimizer_state
from lightning_gsched.runtime import (
    ModelRuntime,
    Pieces,
    PretrainedWeights,
    PretrainedWeightsError,
    ProgramExecutor,
    align_generators,
    is_deferred,
)
from lightning_gsched.schedule.plan import Plan
from lightning_gsched.schedule.replicas import ReplicaLayout

_T = TypeVar("_T")



class PipelineBuild:
    """What a pipeline engine holds and how it builds its runtime (see the module doc).

    ``optimizers()`` gives the optimizers whose state is pruned to the owned parameters when the
    runtime is built and restored in full by :meth:`close`; ``info(text)`` prints the plan;
    ``forward_context`` (optional) is entered around every stage forward (Fabric's precision).
    ``control``: the group the engine's own collectives use and the job's failure notice
    (:mod:`.control`; the Trainer strategy's); None: the default group.
    ``init_weights``: a deferred model's kept parameters are read from these safetensors files
    (runtime/pretrained.py) instead of initialised.
    ``device_mesh``: the front end's (pipeline, data_parallel) mesh (:mod:`.mesh`); the build
    makes it if setup could not (``"auto"``: G is the pick's). None: no mesh.
    ``checkpoints``: the front end's checkpoint service (:mod:`.checkpoint`; it outlives the
    engine: Lightning saves and loads before setup and after teardown); the build applies the
    restore it holds for a model built without weights, to what this rank keeps.
    ``tensor_parallel_plan``: with ``config.tensor_parallel_size`` = T > 1, how each stage is
    sharded over its worker's T ranks (``mesh["tensor_parallel"]``). The engine's collectives
    then span all ``world_size`` ranks while the pipeline (rows, programs, start-up rows) is the
    workers': :attr:`worker` is this rank's, and of a worker's T ranks only ``t = 0`` reports
    losses, logged values and outputs (the T ranks compute the same ones).
    """

    def __init__(self, module: nn.Module, config: ScheduleConfig, options: PartitionOptions,
                 *, world_size: int, rank: int, timeout: float,
                 optimizers: Callable[[], list[Any]], info: Callable[[str], None],
                 forward_context: Callable[[], AbstractContextManager[Any]] | None = None,
                 transport: str = "auto", control: ControlGroup | None = None,
                 device: torch.device | None = None,
                 init_weights: PretrainedWeights | None = None,
                 device_mesh: DeviceMeshSlot | None = None,
                 checkpoints: CheckpointService | None = None,
                 tensor_parallel_plan: TensorParallelPlan | None = None) -> None:
        self.module = module
        # T > 1: each worker of the plan is T consecutive ranks, its stages sharded over them
        # by the plan (partition/tensor_parallel.py); see the worker properties below
        self.tensor_parallel_plan = tensor_parallel_plan
        # the front end's device_mesh: made at setup for a named schedule, else at the build
        self.device_mesh = device_mesh
        self.init_weights = init_weights
        self.checkpoints = checkpoints
        self.config = config
        self.options = options
        # made once, at the build, with the partition's tied weights (config.check at setup)
        self.train_plan: Plan | None = None
        self.world_size, self.rank = world_size, rank
        self.timeout = timeout
        self.transport = transport
        self.optimizers = optimizers
        self.info = info
        self.forward_context = forward_context
        self.runtime: ModelRuntime | None = None
        self.partition: Partition | None = None
        self.failed = False
        self.losses_and_logs: LossLogExchange | None = None
        self.control = control
        self.memory = MemoryReport(control)  # predicted bytes per rank; measured after one step
        # built without weights (runtime/materialize.py): each rank initialises what it keeps
        self.deferred = False
        self.device_hint = device if device is not None else torch.device("cpu")
        # the batch-size exchange, the row map and the row exchange of every step
        self.step_rows = StepRows(config, rank, world_size, lambda: self.group,
                                  self.collective, lambda: self.host_group)
        # torch.compile'd modules: AOTAutograd's buffer donation off from the build to close
        # (partition/compiled.py: the strategy runs some backwards twice)
        self.donation_off: DonationOff | None = None
        # a direct call of the model while the pipeline runs is refused (engine/whole_call.py)
        self.whole_call_guard: Any = None


    # ------------------------------------------------------------------ state

    @property
    def group(self) -> Any:
        """The group of the engine's collectives (None: the default group). Read at each use,
        never kept: an aborted group must lose its last reference to close its connections."""
        return self.control.group if self.control is not None else None

    @property
    def host_group(self) -> Any:
        """The group for host numbers (the control group's gloo twin on a GPU job; None: the
        default group). Read at each use, as :attr:`group`."""
        return self.control.host_group if self.control is not None else None

    @property
    def workers(self) -> Workers:
        """The ranks as the plan's workers (:mod:`.workers`), as the config has them now: a T
        that ``"auto"`` searches is 1 until its pick."""
        return self.config.workers(self.world_size, self.rank)

    @property
    def tensor_parallel_size(self) -> int:
        return self.workers.tensor_parallel_size

    @property
    def worker(self) -> int:
        """This rank's worker (rank ``worker * T + t``): whose program it runs."""
        return self.workers.worker

    @property
    def built(self) -> bool:
        return self.runtime is not None

    @property
    def executor(self) -> ProgramExecutor | None:
        """The executor under the runtime, for tools that time or count it (benchmarks, tests)."""
        return self.runtime.executor if self.runtime is not None else None

    @property
    def device(self) -> torch.device:
        """Where the stages live (and losses and outputs are returned)."""
        return self.require_runtime().device

    def require_runtime(self) -> ModelRuntime:
        """The runtime; it exists from the build on."""
        assert self.runtime is not None, "the pipeline is built at the first batch"
        return self.runtime

    def _probe(self, caller: StepCaller, micro_batch: Any, training: bool) -> CallArgs:
        """Run the user's step once on the full local model to check the step contract.

        A model built without weights (deferred) cannot run: only the call of the model is
        captured; the loss is checked at the first step, when the stages compute it. The run
        leaves the module's state as it found it (buffers, RNG, plain attributes such as a
        torchmetrics Metric's states): the step's real runs come later, once per microbatch."""
        if self.deferred:
            return caller.capture(micro_batch)
        with preserved_tensors_and_rng(self.module), python_state_kept(self.module), \
                torch.no_grad():
            call = caller.probe(micro_batch)
        if training:
            step_loss(call.result, caller.name)
        return call.args, call.kwargs

    def _prepare_compiled(self) -> None:
        """torch.compile'd modules (partition/compiled.py): refused where they cannot run
        (tensor parallelism, a split backward: every rank alike, before any collective; "auto"
        leaves split schedules out), else AOTAutograd's buffer donation off until close, before
        anything compiles a backward."""
        compiled = compiled_modules(self.module)
        if not compiled:
            return
        if self.tensor_parallel_size > 1:
            raise StrategyConfigError(tensor_parallel_refusal(self.tensor_parallel_size,
                                                              compiled))
        if self.config.decided and self.config.splits_backward():
            raise StrategyConfigError(split_backward_refusal(self.config.schedule or "custom",
                                                             compiled))
        if self.donation_off is None:
            self.donation_off = DonationOff()
            if self.rank == 0:
                self.info(donation_line(compiled))

    def build(self, caller: StepCaller, micro_batch: Any, training: bool, global_rows: int = 0,
              micro_of: Callable[[], Any] | None = None) -> None:
        """Partition the model, build the runtime, release non-owned stages (collective).

        Without a training plan (``"auto"``), first choose one for ``global_rows`` rows; then
        ``micro_of()`` gives the first microbatch under the pick, the one the partition and the
        memory prediction are made on (as for a schedule given by name). The phases, in order:
        check the step (:meth:`_probe`), choose (:meth:`_choose`), plan (:meth:`_plan`), give
        each rank its weights (:meth:`_place_weights`), start the runtime. All of it inside
        ``forward_context`` (Fabric's precision), as the Trainer's precision context surrounds
        its step: the build runs the model on the captured call, whose inputs the front end
        already cast (bf16-mixed: float inputs in bfloat16, which a float32 layer refuses
        outside autocast)."""
        with torch.inference_mode(False), (self.forward_context or nullcontext)():
            _refuse_sharded_before_split(self.module)
            _refuse_step_synced_metrics(self.module)
            self.deferred = is_deferred(self.module)
            self._prepare_compiled()
            if self.init_weights is not None and not self.deferred:
                raise PretrainedWeightsError(
                    f"init_weights={str(self.init_weights.path)!r} is given but the model was "
                    "built with weights, so every rank holds all of them already. Build it "
                    "without weights (in configure_model(), or under trainer.init_module()) to "
                    "have each rank read only its own, or drop init_weights and load the "
                    "weights yourself (load_state_dict)")
            args, kwargs = normal_call(self._probe(caller, micro_batch, training))
            if self.world_size > 1:
                self.collective("the build's weight broadcast",
                                 lambda: sync_module_states(self.module, self.group))
            # the stages measured once: the tuner's passes serve the memory report where they
            # measured its cut on its microbatch (measure/build_passes.py)
            passes = BuildPasses()
            if not self.config.decided:
                self._choose(caller, micro_batch, training, global_rows, args, kwargs, passes)
                if micro_of is not None:
                    args, kwargs = normal_call(caller.capture(micro_of()))
            part, plan = self._plan(caller, micro_batch, training, args, kwargs)
            pieces = self._place_weights(part, plan, args, kwargs, passes)
            self.runtime = ModelRuntime(self.module, part.stages, plan.programs,
                                        timeout=self.timeout, sync_weights=False,
                                        forward_context=self.forward_context,
                                        checkpointed=plan.checkpointed,
                                        transport=self.transport,
                                        # a model built without weights is the large-model
                                        # path, where the process's memory is the
                                        # constraint (runtime/host_heap.py)
                                        release_heap_each_step=self.deferred,
                                        tensor_parallel_size=self.tensor_parallel_size,
                                        pieces=pieces,
                                        # one job-wide first failure: a peer waiting in a
                                        # control collective quotes the step's root cause
                                        notice=(self.control.notice if self.control is not None
                                                else None))
            self.runtime.prune_optimizer_state(self.optimizers())
            self.whole_call_guard = whole_call.install(self.module, self.runtime, self.rank)
            self._align_generators()  # the build drew on some ranks only (traces, measures)
            memory = self.runtime.memory()
            rows = startup_rows(plan, memory, self.workers, self.group, self.collective)
        if self.rank == 0:
            self.info(startup_text(plan, part, memory,
                                   custom=(self.config.arguments is not None
                                           and self.config.arguments.placement is not None),
                                   memory_lines=self.memory.startup_lines(),
                                   header=self.config.choice_text, rows=rows))

    def _choose(self, caller: StepCaller, micro_batch: Any, training: bool, global_rows: int,
                args: tuple[Any, ...], kwargs: dict[str, Any], passes: BuildPasses) -> None:
        """``"auto"``: the tuner picks the schedule for ``global_rows`` rows (collective). It
        runs the step's code after ``self(...)`` with the last stage's profile: its effects on
        the module (a Metric's update) are undone."""
        with python_state_kept(self.module):
            loss_fn = step_loss_fn(caller, micro_batch) if training else None
            choose_schedule(self.module, self.config, self._split_options(), args, kwargs,
                            loss_fn=loss_fn, global_rows=global_rows,
                            optimizers=self.optimizers(), world_size=self.world_size,
                            rank=self.rank, forward_context=self.forward_context,
                            group=self.group, passes=passes,
                            tensor_parallel=self._tensor_parallel_tuning(),
                            collective=self.collective, calibration_group=self.host_group)

    def _plan(self, caller: StepCaller, micro_batch: Any, training: bool,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Partition, Plan]:
        """The partition, its tied weights placed, the stages' costs, the training plan, and
        (``"auto"``: G known only now) the device mesh."""
        part = self.partition = self._partition(args, kwargs)
        if self.config.splits_backward() and (found := reentrant_checkpoints(part.stages)):
            raise StrategyConfigError(reentrant_refusal(self.config.schedule or "custom", found))
        # tied weights are placed by the plan: the one plan is made once the partition names
        # them
        self.config.set_ties(part.shared_parameters.values())
        if self.config.profile_costs:  # the order from the stages' seconds (rank 0's)
            with python_state_kept(self.module):  # as for the tuner (_choose)
                self._profile_costs(part, args, kwargs,
                                    step_loss_fn(caller, micro_batch) if training else None)
        else:  # at the default costs, what a first stage's split backward really costs
            self.config.plan_first_stage_backward_in_w(self.world_size)
        plan = self.train_plan = self.config.training_plan(self.world_size)
        mesh = self.device_mesh
        if mesh is not None:  # "auto": G is the pick's, known now (else made at setup)
            self.collective("the device mesh", lambda: mesh.make_for(
                self.world_size, plan.data_parallel_size, self.device_hint.type,
                self.tensor_parallel_size))
        return part, plan

    def _place_weights(self, part: Partition, plan: Plan, args: tuple[Any, ...],
                       kwargs: dict[str, Any], passes: BuildPasses) -> Pieces:
        """The memory prediction, then each rank's weights: its tensor-parallel shards, and
        for a model built without weights its own stages' weights drawn or read (or a
        checkpoint set aside); the pieces a sharded rank holds."""
        # sized before the runtime releases the stages this rank does not own (sharded
        # stages: after the sharding, below)
        if self.tensor_parallel_size == 1:
            self._predict_memory(part, args, kwargs, plan, passes)
        passes.clear()  # their tensors (a microbatch's activations per stage count) go
        pieces: Pieces = {}
        if self.tensor_parallel_size > 1:
            # before a model built without weights gets any (still on the meta device), so
            # each rank draws or reads only its pieces, one module's full tensors at a time;
            # the check run on the microbatch needs weights (the other workers' are absent)
            self._shard_stages(part, None if self.deferred else (args, kwargs))
            pieces = pieces_of(self.module)
            # each rank's bytes are its shards': worker 0's T ranks size the sharded stages
            # together (on meta tensors for a model built without weights)
            self._predict_memory(part, args, kwargs, plan, None)
        if self.deferred:  # weights for this rank's stages only (engine/weights.py)
            seed = self.collective("the seed broadcast",
                                    lambda: agreed_seed(self.world_size, self.group))
            # a checkpoint resumed into the model (checkpoint.py), set aside until now
            checkpoints = self.checkpoints
            materialize(self.module, part.stages, plan.programs, self.worker, seed,
                        self.device_hint, self.init_weights,
                        checkpoints.take_restore() if checkpoints is not None else None,
                        self.optimizers(), pieces, self.collective, reports=self.rank == 0)
        if self.tensor_parallel_size > 1:
            # state loaded before the build (a resumed checkpoint, or restored just above) was
            # made for full parameters
            shard_optimizer_state(self.optimizers(), self.module)
        return pieces

    def _predict_memory(self, part: Partition, args: tuple[Any, ...], kwargs: dict[str, Any],
                        plan: Plan, passes: BuildPasses | None) -> None:
        """Every rank's predicted bytes (collective), from the stages as they will run: with
        tensor parallelism the sharded stages, which worker 0's T ranks measure together."""
        self.collective("the build's memory prediction", lambda: self.memory.predict(
            part.stages, args, kwargs, plan, self.optimizers(), self.world_size, self.rank,
            passes=passes, stage_units=part.stage_units, device_type=self.device_hint.type,
            measurers=self.tensor_parallel_size, worker=self.worker))

    def _shard_stages(self, part: Partition,
                      check_call: tuple[tuple[Any, ...], dict[str, Any]] | None) -> None:
        """Every stage sharded over this worker's T ranks (:func:`.weights.shard_stages`)."""
        if self.device_mesh is None:
            raise StrategyConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs the strategy's device "
                "mesh, which this engine was built without")
        tp_mesh = self.device_mesh.dimension(TENSOR_PARALLEL)
        self._align_generators()  # the check runs below draw dropout masks like a step
        shard_stages(part.stages, self._tensor_parallel_plan(), tp_mesh, check_call,
                     self.collective)

    def _align_generators(self) -> None:
        """A tensor-parallel worker's ranks take its first rank's generator states (collective
        over the worker; runtime/aligned_rng.py says why)."""
        if self.tensor_parallel_size == 1 or self.device_mesh is None:
            return
        group = self.device_mesh.dimension(TENSOR_PARALLEL).get_group()
        self.collective("the tensor-parallel ranks' generators",
                         lambda: align_generators(group, self.device_hint))

    def _split_options(self) -> PartitionOptions:
        """The partition options, with a tensor-parallel plan's modules and their holders kept
        whole (:func:`~lightning_gsched.partition.tensor_parallel.kept_whole` says why)."""
        if self.tensor_parallel_plan is None:
            return self.options
        return replace(self.options, leaf_modules=with_kept_whole(
            self.options.leaf_modules, self.module, self.tensor_parallel_plan))

    def _tensor_parallel_plan(self) -> TensorParallelPlan:
        if self.tensor_parallel_plan is None:
            raise StrategyConfigError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs a tensor_parallel_plan "
                "(module-name patterns to styles, or a function parallelize(stage, tp_mesh))")
        return self.tensor_parallel_plan

    def _tensor_parallel_tuning(self) -> TensorParallelTuning | None:
        """What ``"auto"`` needs to profile the stages sharded, for each T it tries (None:
        T = 1 only)."""
        sizes = self.config.tensor_parallel_candidates(self.world_size)
        if sizes == (1,):
            return None
        return TensorParallelTuning(sizes, self._tensor_parallel_plan(),
                                    self.device_hint.type, self.timeout)

    def build_auto(self, batch: Any, rows: list[int], caller: StepCaller,
                     training: bool) -> Held:
        """The first batch of an undecided ``"auto"``: the tuner profiles the first microbatch of
        its own cut (:func:`.auto.probe_parts`, the global batch in rank order), which every
        rank receives; the build then probes the first microbatch under the pick, which every
        rank receives too and keeps for the step (returned)."""
        parts = probe_parts(self.config, sum(rows), self.workers.count)
        tuner_cut = self.step_rows.row_map(rows, parts, exact=training,
                                           replicas=ReplicaLayout(self.workers.count, 1))
        held = [Held()]

        def first() -> Any:
            held[0] = self.step_rows.first_micro(batch, self.step_rows.step_cut(rows, training))
            return held[0].first()

        self.build(caller, self.step_rows.first_micro(batch, tuner_cut).first(), training,
                   global_rows=sum(rows), micro_of=first)
        return held[0]

    def _profile_costs(self, part: Partition, args: tuple[Any, ...], kwargs: dict[str, Any],
                       loss_fn: Callable[[Any], torch.Tensor] | None) -> None:
        """``profile_costs=True``: every rank plans with rank 0's timings of the stages on
        this microbatch (:mod:`.profiled_costs`); the startup text says which."""
        if self.deferred:  # the same on every rank: refused before any collective
            raise StrategyConfigError(
                "profile_costs=True times the stages on rank 0 before the plan exists, but the "
                "model was built without weights (each rank gets only its own later). Pass "
                "forward_cost/backward_cost/weight_cost yourself (e.g. from "
                "lightning_gsched.measure.profile_stages on a smaller copy), or drop "
                "profile_costs")
        costs = profiled_costs(self.module, part.stages, args, kwargs, loss_fn,
                               split_backward=self.config.splits_backward(), rank=self.rank,
                               world_size=self.world_size, group=self.group,
                               collective=self.collective,
                               forward_context=self.forward_context)
        self.config.set_costs(costs)
        self.config.choice_text = costs_text(costs)

    def _partition(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Partition:
        """The model cut into the decided schedule's S stages (:func:`.cut.cut_model`). Too
        few units left by the holders a tensor-parallel plan keeps whole is refused as the
        plan's doing (:func:`~lightning_gsched.partition.tensor_parallel.too_few_units`)."""
        try:
            return cut_model(self.module, self.config.resolved(self.world_size)[0],
                             self._split_options(), args, kwargs, rank=self.rank,
                             world_size=self.world_size, group=self.group,
                             collective=self.collective)
        except TooManyStagesError as exc:
            holders = (kept_holders(self.module, self.tensor_parallel_plan)
                       if self.tensor_parallel_plan is not None else {})
            if holders:
                raise TensorParallelPlanError(too_few_units(exc, holders)) from exc
            raise

    def collective(self, what: str, collective: Callable[[], _T]) -> _T:
        """One of the engine's collectives (``what`` names it in a fault); a backend failure
        becomes a RuntimeFault quoting the job's first failure (:mod:`.control`). Public: the
        checkpoint service runs the runtime's gathers through it."""
        if self.control is None:
            return collective()
        try:
            return self.control.run(what, collective)
        except RuntimeFault:
            self.failed = True
            raise


def _refuse_sharded_before_split(module: nn.Module) -> None:
    """A model whose parameters are already ``DTensor`` shards is refused, naming them: the
    split runs on whole modules and the stages are sharded after it, by ``tensor_parallel_plan``
    (the same patterns and styles). Why here: a user coming from ModelParallelStrategy calls
    ``parallelize_module`` in ``configure_model`` itself, and the split then failed inside
    torch ("mixed torch.Tensor and DTensor") with advice about the example."""
    from torch.distributed.tensor import DTensor

    sharded = [name for name, param in module.named_parameters() if isinstance(param, DTensor)]
    if sharded:
        raise StrategyConfigError(
            f"{type(module).__name__}'s parameters are already sharded as DTensors ("
            f"{', '.join(sharded[:4])}{', ...' if len(sharded) > 4 else ''}), e.g. by "
            "parallelize_module in configure_model as under ModelParallelStrategy. "
            "GeneralParallel splits the whole model into stages first and shards each stage "
            "after: remove that call and pass its plan as tensor_parallel_plan= with "
            "tensor_parallel_size= (the same module-name patterns and styles; "
            "docs/tensor_parallel.md)")


def _refuse_step_synced_metrics(module: nn.Module) -> None:
    """A torchmetrics ``Metric(dist_sync_on_step=True)`` held by the model is refused, naming
    it: its forward runs a collective over every rank, but a step's code after the model's
    call runs on the rank computing the loss only, so the collective waited for peers that
    never call it until ``step_timeout`` (found by probing). The strategy reduces what the
    step logs over the global batch anyway."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - Lightning installs torchmetrics
        return
    synced = [name for name, sub in module.named_modules()
              if isinstance(sub, Metric) and getattr(sub, "dist_sync_on_step", False)]
    if synced:
        raise StrategyConfigError(
            f"the torchmetrics Metric(s) {', '.join(map(repr, synced))} of "
            f"{type(module).__name__} sync on every step (dist_sync_on_step=True): under "
            "GeneralParallel a step's code after the model's call runs on the rank that "
            "computes the loss only, so that collective would wait for the other ranks. Drop "
            "dist_sync_on_step: a Metric logged with self.log(name, metric) gets the global "
            "batch's value at every step, and compute() syncs every rank at the epoch's end")
