"""What a front end tells about memory: predicted bytes per rank at startup, then predicted
beside measured once a step with optimizer state has run.

Why in the front end's engine: only there are the model's first microbatch (to size the stages),
the user's optimizers (their state is a third of Adam's footprint) and the point where a step
with that state starts (the second training step: the state appears at the first
``optimizer.step``). The numbers come from the planner (``schedule/memory.py``) and from the
runtime's accounting (``ModelRuntime.record_memory``); this module only runs them at the right
moments, sizes the stages on rank 0 (one broadcast), gathers the ranks' predictions (each
rank predicts its own, from its own program: one collective) and the ranks' measured figures
(one collective, once).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from lightning_gsched.engine.control import ControlGroup
from lightning_gsched.engine.logsync import exchange
from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.measure.build_passes import BuildPasses
from lightning_gsched.measure.stage_pass import measure_stage_bytes
from lightning_gsched.partition.meta_run import has_meta_parameters, on_meta, to_meta
from lightning_gsched.runtime import ModelRuntime, optimizer_factor, optimizer_step_factor
from lightning_gsched.schedule.describe import comparison_text, predicted_text
from lightning_gsched.schedule.memory import ModelSizes, RankMemory, predict_memory
from lightning_gsched.schedule.plan import Plan

MEASURED_STEP = 1  # the second training step (0-based): the optimizer state exists by then


def optimizer_bytes_factor(optimizers: Sequence[Any]) -> float:
    """Optimizer state bytes per parameter byte the user's optimizers will keep (the largest;
    0 when none is known, e.g. before ``configure_optimizers`` or for an unknown optimizer)."""
    factors = [optimizer_factor(opt) for opt in optimizers]
    return max((f for f in factors if f is not None), default=0.0)


class MemoryReport:
    """Predicted bytes per rank (at build) and the measured comparison (after one step)."""

    def __init__(self, control: ControlGroup | None = None) -> None:
        self.control = control  # its collectives' group is control.group (None: the default)
        self.sizes: ModelSizes | None = None
        self.predicted: list[RankMemory] | None = None
        self.measured: list[dict[str, int]] | None = None  # every rank's, after MEASURED_STEP
        self.device_peaks: list[int | None] = []
        self.unavailable: str | None = None
        self.steps = 0

    def predict(self, stages: Sequence[torch.nn.Module], args: tuple[Any, ...],
                kwargs: dict[str, Any], plan: Plan, optimizers: Sequence[Any],
                world_size: int = 1, rank: int = 0, passes: BuildPasses | None = None,
                stage_units: list[list[str]] | None = None,
                device_type: str | None = None, measurers: int = 1,
                worker: int | None = None) -> None:
        """Size the stages on one microbatch (the loss's own saved tensors are not known yet:
        the user's step computes it) and predict every rank's bytes for the training plan.

        Every rank holds the same model and microbatch, so rank 0 alone runs the stages'
        forwards and broadcasts the sizes (collective): the other ranks skip that work, and all
        of them agree on whether a prediction exists, which decides whether they take part in
        the measured step's gather. ``passes``/``stage_units``: the build's measuring passes
        and the cut of ``stages``; where a pass measured that cut on this microbatch (``"auto"``),
        its bytes are reused rather than measured again (measure/build_passes.py).
        ``device_type``: where the run trains (the optimizer's step allocates by device).
        ``measurers``: ranks ``0 .. measurers - 1`` run the stages together (tensor-parallel
        stages: worker 0's T ranks, whose layers' collectives need each other); rank 0's sizes
        are every rank's. ``worker``: whose program this rank runs (default: ``rank``; with
        tensor parallelism ``rank // T``, each of a worker's ranks predicting the same)."""
        outcome: tuple[ModelSizes | None, str | None] = (None, None)
        if rank < measurers:
            try:
                # a deferred model (no weights yet) is sized on meta tensors
                deferred = any(has_meta_parameters(stage) for stage in stages)
                factor = optimizer_bytes_factor(optimizers)
                if deferred:
                    with on_meta(*stages):
                        sizes = measure_stage_bytes(stages, to_meta(args), to_meta(kwargs),
                                                    optimizer_factor=factor)
                elif passes is not None and stage_units is not None:
                    sizes = passes.stage_bytes(stage_units, stages, args, kwargs, factor)
                else:
                    sizes = measure_stage_bytes(stages, args, kwargs, optimizer_factor=factor)
                step = max((optimizer_step_factor(opt, device_type) for opt in optimizers),
                           default=0.0)
                outcome = (replace(sizes, optimizer_step=step), None)
            except Exception as exc:  # noqa: BLE001 - a report must never stop the training
                outcome = (None, f"{type(exc).__name__}: {exc}")
        if world_size > 1:
            box: list[Any] = [outcome]
            dist.broadcast_object_list(box, 0, group=_group(self.control))
            outcome = box[0]
        self.sizes, self.unavailable = outcome
        if self.sizes is not None:
            self.predicted, self.unavailable = self._predict_ranks(
                self.sizes, plan, world_size, rank if worker is None else worker)

    def _predict_ranks(self, sizes: ModelSizes, plan: Plan, world_size: int, worker: int,
                       ) -> tuple[list[RankMemory] | None, str | None]:
        """Every rank's prediction, each made by its own rank from its own program and
        gathered (collective): (the list, None), or (None, why) on every rank alike.

        Why not each rank predicting every rank: that reads every rank's program, which a plan
        of many ranks lowers per rank when first read (schedule/lazy_ranks.py): a minute and
        gigabytes per rank at W=1024. Gathered, the figures are the same."""
        # a sent buffer is released when its send completes, on every backend
        # (runtime/transport.py: SendReleaser): a handed-off gradient leaves at its REDUCE
        mine: tuple[RankMemory | None, str | None]
        try:
            mine = (predict_memory(plan.programs, sizes, plan.checkpointed,
                                   ranks=[worker])[0], None)
        except ScheduleConfigError:
            raise  # the sizes do not fit the plan: checked without programs, every rank alike
        except Exception as exc:  # noqa: BLE001 - a report must never stop the training
            mine = (None, f"{type(exc).__name__}: {exc}")
        gathered = exchange(mine, world_size, _group(self.control))
        failed = next((why for _, why in gathered if why is not None), None)
        if failed is not None:  # every rank sees the same list, so all agree
            return None, failed
        return [memory for memory, _ in gathered if memory is not None], None

    def startup_lines(self) -> str:
        if self.predicted is None:
            return f"    memory prediction unavailable ({self.unavailable})"
        return predicted_text(self.predicted)

    def before_step(self, runtime: ModelRuntime) -> None:
        if self.steps == MEASURED_STEP and self.predicted is not None:
            runtime.record_memory(True)
            if runtime.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(runtime.device)

    def after_step(self, runtime: ModelRuntime, optimizers: Sequence[Any], world_size: int,
                   rank: int, info: Callable[[str], None]) -> None:
        """After the measured step: gather every rank's peaks (collective) and print them."""
        step, self.steps = self.steps, self.steps + 1
        if step != MEASURED_STEP or self.predicted is None:
            return
        measured = runtime.measured_memory(optimizers)
        runtime.record_memory(False)
        device_peak = (torch.cuda.max_memory_allocated(runtime.device)
                       if runtime.device.type == "cuda" else None)
        mine = (measured.peaks if measured is not None else {}, device_peak)
        gathered = exchange(mine, world_size, _group(self.control))
        self.measured = [peaks for peaks, _ in gathered]
        self.device_peaks = [peak for _, peak in gathered]
        if rank == 0:
            info(comparison_text(self.predicted, self.measured, step + 1, self.device_peaks))


def _group(control: ControlGroup | None) -> Any:
    """``control.group``, read at each use (an aborted group must not be kept alive)."""
    return getattr(control, "group", None)
