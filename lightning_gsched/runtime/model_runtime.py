"""``ModelRuntime``: the one object a training front end talks to.

The Trainer and Fabric strategies need the same of a running schedule: a step whose gradients are
held until the loop's backward, clipping by the whole model's norm, the parameters this rank
updates, the full model and optimizer state, parameter memory, and stopping every rank on a
failure. Seeing only this facade, they let the executor and its buffers change behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_gsched.runtime import fullstate
from lightning_gsched.runtime.channels import Channels, FaultNotice
from lightning_gsched.runtime.compute import CallArgs, ForwardContext, LossFn
from lightning_gsched.runtime.executor import ProgramExecutor
from lightning_gsched.runtime.flat import FlatStage, set_storage
from lightning_gsched.runtime.footprint import MeasuredBytes, optimizer_state_bytes
from lightning_gsched.runtime.handover import GradStash
from lightning_gsched.runtime.host_heap import release_free_heap
from lightning_gsched.runtime.layout import StepResult
from lightning_gsched.runtime.materialize import Pieces
from lightning_gsched.runtime.ownership import Ownership
from lightning_gsched.schedule.program import Programs


@dataclass(frozen=True)
class ParameterMemory:
    """Parameter bytes by category on one rank."""

    stage_bytes: list[int]  # every stage's weights (the same numbers on every rank)
    tie_bytes: dict[int, int]  # every tie's weights, by home stage (the same on every rank)
    owned_stages: list[int]  # stages resident here at all times (and their ties)
    resident_bytes: int  # real storage of the stage and tie buffers now (owned + fetched)


class ModelRuntime:
    """This rank's share of ``module`` (each rank's identical replica, where parameters no stage
    reads but the step does, e.g. a loss module, are found) trained by ``plan(...).programs`` on
    ``partition(...).stages``. Other arguments are :class:`ProgramExecutor`'s, except
    ``release_heap_each_step``: return the C heap's free pages at every step's start and after the
    hand-over (:mod:`.host_heap`), for models whose memory is the constraint (costs a small model
    ~15% of its step on CPU). ``executor``: for tools that time or count what it does."""

    def __init__(self, module: nn.Module, stages: Sequence[nn.Module], programs: Programs, *,
                 timeout: float = 300.0, sync_weights: bool = True,
                 channels: Channels | None = None, forward_context: ForwardContext | None = None,
                 checkpointed: Sequence[bool] | None = None,
                 transport: str = "auto", release_heap_each_step: bool = False,
                 tensor_parallel_size: int = 1, pieces: Pieces | None = None,
                 notice: FaultNotice | None = None) -> None:
        self.module = module
        self.executor = ProgramExecutor(stages, programs, channels=channels, timeout=timeout,
                                        sync_weights=sync_weights, forward_context=forward_context,
                                        checkpointed=checkpointed, transport=transport,
                                        tensor_parallel_size=tensor_parallel_size,
                                        notice=notice)
        self.rank = self.executor.rank
        self.world_size = programs.world_size
        self.device = self.executor.device
        self.ownership = Ownership.of(self.executor, module)
        # a split backward accumulates what loss.backward() would: the extras the loss reads
        self.executor.compute.loss_params = list(self.ownership.extra)
        # the parameters held as tensor-parallel pieces (T > 1): norms and full state need them
        self.pieces: Pieces = pieces or {}
        self._grads = GradStash(self.executor, self.ownership, self.rank, self.world_size,
                                self.executor.channels.workers_group,
                                self.executor.channels.tensor_parallel, set(self.pieces))
        self._stream: fullstate.StreamPlan | None = None  # a described streamed save
        self.release_heap_each_step = release_heap_each_step
        # the parameters now live in the stage buffers: the tensors they were built in are free
        release_free_heap(self.device)

    @property
    def first_stage_micros(self) -> list[int]:
        """Microbatches whose inputs :meth:`step` needs on this rank."""
        return self.executor.first_stage_micros

    @property
    def closed(self) -> bool:
        """True after :meth:`close`, :meth:`abort` or a failed step: it cannot run again."""
        return self.executor.channels.closed

    def step(self, inputs: Mapping[int, CallArgs], loss_fn: LossFn, *,
             signature: Hashable | None = None, drop_previous_grads: bool = False,
             on_computed: Callable[[dict[int, Any]], None] | None = None) -> StepResult:
        """One step; its gradients are held here until :meth:`hand_over`, and ``param.grad`` stays
        as before it (None with ``drop_previous_grads``: the loop zeroes them before hand-over)."""
        self._grads.before_step(drop_previous=drop_previous_grads)
        if self.release_heap_each_step:  # what the last step freed, before this one allocates
            release_free_heap(self.device)
        result = self.executor.step(inputs, loss_fn, signature=signature, on_computed=on_computed)
        self._grads.after_step()
        return result

    def forward(self, programs: Programs, inputs: Mapping[int, CallArgs],
                output_fn: Callable[[Any, int], Any], *,
                signature: Hashable | None = None) -> dict[int, Any]:
        """A forward-only run; gradients are untouched."""
        return self.executor.forward(programs, inputs, output_fn, signature=signature)

    def _absent_units(self) -> list[FlatStage]:
        """The stage and tie buffers whose weights this rank does not hold now: their
        parameters are empty tensors here between the fetches of a step (runtime/flat.py)."""
        return [unit for unit in [*self.executor.flats, *self.executor.ties.values()]
                if not unit.materialized]

    def absent_stages(self) -> list[int]:
        """Stages (a tie: its home stage) whose weights this rank does not hold now."""
        return sorted({unit.index for unit in self._absent_units()})

    def absent_to_meta(self) -> None:
        """The parameters of :meth:`absent_stages` become meta tensors of their full shapes
        (from empty ones), for a run ending without a gather: the module is then a model
        built without weights where this rank holds nothing, which a checkpoint can be
        restored into at the next build (engine/checkpoint.py), instead of one whose empty
        parameters no load fits. Not for tensor-parallel pieces (their shapes are local)."""
        for unit in self._absent_units():
            for param, shape in zip(unit.params, unit.shapes, strict=True):
                set_storage(param, torch.empty(shape, dtype=unit.dtype, device="meta"))

    def owned_parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank updates (optimizer state is kept for these only)."""
        return self.ownership.owned

    def primary_parameters(self) -> list[nn.Parameter]:
        """What this rank counts (norms) and writes (checkpoints): each parameter on one rank."""
        return self.ownership.primary

    def written_parameters(self) -> list[nn.Parameter]:
        """What this rank writes into a sharded checkpoint: each parameter, frozen ones too,
        on one rank (its unit's first owner; parameters outside the stages on rank 0)."""
        return self.ownership.written

    def stage_parameters(self) -> list[nn.Parameter]:
        """Parameters that live in a stage or tie buffer (owned here or not): all but extra."""
        return self.ownership.in_stages

    def hand_over(self, scale: float = 1.0) -> None:
        """``param.grad += scale * gradient of the last step`` (assigned where None), as
        ``loss.backward()`` would; a second call without a step hands over nothing."""
        self._grads.hand_over(scale)
        if self.release_heap_each_step:  # the step's transients, before the optimizer allocates
            release_free_heap(self.device)

    def clip_grad_norm(self, params: Sequence[nn.Parameter], max_norm: float,
                       norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model (collective): the norm counts
        each parameter once over all ranks; returns that total norm."""
        return self._grads.clip_by_norm(list(params), float(max_norm), float(norm_type),
                                        error_if_nonfinite)

    def parameter_grad_norms(self, params: Sequence[nn.Parameter], norm_type: float = 2.0
                             ) -> list[torch.Tensor | None]:
        """Each parameter's gradient norm as one device has it (collective; None: no
        gradient), whichever rank holds it (see ``GradStash.parameter_norms``)."""
        return self._grads.parameter_norms(list(params), float(norm_type))

    # full state: collective, every rank calls each in the same order (see :mod:`.fullstate`)

    def full_state_dict(self) -> dict[str, Any]:
        """The module's full state dict on rank 0, ``{}`` elsewhere."""
        return fullstate.full_state_dict(self.module, self.executor, self.world_size,
                                         self.executor.channels.workers_group,
                                         self.executor.channels.tensor_parallel, self.pieces)

    def full_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every parameter's state on rank 0, ``{}`` elsewhere."""
        return fullstate.full_optimizer_state(optimizer, self.ownership.primary, self.rank,
                                              self.world_size,
                                              self.executor.channels.workers_group)

    def streamed_state_dict(self) -> dict[str, Any]:
        """:meth:`full_state_dict` with placeholders for the stage parameters (no data moves):
        starts a streamed save, which :meth:`streamed_optimizer_state` extends and :meth:`stream`
        sends."""
        state, self._stream = fullstate.describe_state_dict(
            self.module, self.executor, self.world_size, self.executor.channels.workers_group,
            self.executor.channels.tensor_parallel, self.pieces)
        return state

    @property
    def streaming(self) -> bool:
        """A streamed save was described (:meth:`streamed_state_dict`) and not yet sent."""
        return self._stream is not None

    def streamed_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """:meth:`full_optimizer_state` with placeholders, after :meth:`streamed_state_dict`."""
        if self._stream is None:
            raise RuntimeError("streamed_optimizer_state() before streamed_state_dict()")
        return fullstate.describe_optimizer_state(self._stream, optimizer, self.ownership.primary)

    def stream(self, sink: fullstate.Sink | None,
               on_hold: Callable[[int], None] | None = None) -> bool:
        """Send the described tensors to rank 0 one at a time (:func:`.fullstate.transfer`);
        False (nothing done) when no streamed save was described since the last one."""
        plan, self._stream = self._stream, None
        if plan is None:
            return False
        fullstate.transfer(plan, sink, on_hold)
        return True

    def stream_kept(self, described: Any) -> Any:
        """:meth:`stream` keeping every tensor on rank 0 in place of its placeholder in
        ``described`` (in place for dicts and lists), for a checkpoint written by a CheckpointIO."""
        plan, self._stream = self._stream, None
        return described if plan is None else fullstate.transfer_kept(plan, described)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state dict into what this rank holds (other stages' entries skipped)."""
        fullstate.load_held_state(self.module, state)

    def prune_optimizer_state(self, optimizers: Sequence[Optimizer]) -> int:
        """Drop the optimizer state of parameters this rank does not own; returns how many."""
        return fullstate.prune_optimizer_state(optimizers, self.ownership.owned)

    def restore_full_model(self, optimizers: Sequence[Optimizer]) -> None:
        """Give every rank the full weights and the optimizers' full state again, then close:
        afterwards the module is an ordinary model, as after DDP."""
        fullstate.restore_full_state(self.executor, optimizers, self.ownership.primary,
                                     self.world_size, self.executor.channels.workers_group)
        self.close()

    def memory(self) -> ParameterMemory:
        flats, ties = self.executor.flats, self.executor.ties
        return ParameterMemory(
            stage_bytes=[flat.nbytes for flat in flats],
            tie_bytes={h: unit.nbytes for h, unit in sorted(ties.items())},
            owned_stages=sorted(self.executor.owned),
            resident_bytes=sum(unit.resident_bytes() for unit in [*flats, *ties.values()]))

    def record_memory(self, enabled: bool = True) -> None:
        """Start (afresh) or stop accounting for the bytes this rank holds during steps."""
        self.executor.record_memory(enabled)

    def measured_memory(self, optimizers: Sequence[Optimizer] = ()) -> MeasuredBytes | None:
        """Peak bytes by category since :meth:`record_memory`, the optimizers' state for the
        parameters this rank updates included (it exists after their first step)."""
        measured = self.executor.measured_memory()
        if measured is None:
            return None
        # constant over a step (it changes in optimizer.step, outside the programs)
        state = sum(optimizer_state_bytes(opt, self.ownership.owned) for opt in optimizers)
        return MeasuredBytes(*({**d, "optimizer": state, "total": d.get("total", 0) + state}
                               for d in (measured.at_peak, measured.peaks)))

    def abort(self, message: str) -> None:
        """A failure outside a step (e.g. in user code before stage 0): tell the job (peers quote
        ``message`` as the first failure) and drop the process groups, so waiting peers fail now."""
        self.executor.abort(message)

    def close(self) -> None:
        """Release the process groups (local)."""
        if not self.closed:
            self.executor.close()
