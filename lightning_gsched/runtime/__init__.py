"""Execute planned programs over torch.distributed: one rank, one program, one step at a time.

    from lightning_gsched.partition import partition
    from lightning_gsched.schedule import plan
    from lightning_gsched.runtime import ProgramExecutor

    part = partition(model, S, example_args=(x,))
    programs = plan("fslpp", workers=W, stages=S, microbatches=B,
                    ties=part.shared_parameters.values()).programs   # tied weights placed too
    executor = ProgramExecutor(part.stages, programs)          # collective: builds process groups
    result = executor.step({b: ((x[b],), {}) for b in range(B)},   # every microbatch: they
                           loss_fn=lambda out, b: F.cross_entropy(out, y[b]))  # give the shapes
    optimizer.step()   # owners' param.grad == gradient of the mean loss over the global batch

    evaluation = plan("fslpp", workers=W, stages=S, microbatches=B2, forward_only=True).programs
    first, last = stage_micros(evaluation, rank)                # inputs run / outputs returned
    outputs = executor.forward(evaluation, {b: ((x2[b],), {}) for b in range(B2)},
                               output_fn=lambda out, b: out.argmax(-1))   # {b: value} for `last`

Training front ends (the Lightning Trainer strategy, the Fabric strategy) use the facade
:class:`ModelRuntime` (:mod:`.model_runtime`): a step with its gradients held until the loop's
backward, the hand-over, clipping by the global norm, owned parameters, full-state gather and
restore, parameter memory, aborting on a failure.

Modules, one job each: :mod:`.wire` (pytree <-> structure, tensors and spec), :mod:`.channels` (process groups,
fault notice), :mod:`.faults` (bounded waits, error messages), :mod:`.transport` (sends, posted
receives; bare tensors once a step signature's shapes are known), :mod:`.flat` (flat weight/gradient buffers, fetch/free), :mod:`.compute` (stage
forward/backward, stash), :mod:`.running_stats` (BatchNorm statistics equal to one device's on
every rank), :mod:`.layout` (which parameters go where), :mod:`.executor` (the program walker),
:mod:`.step` and :mod:`.unit_traffic` (one step's actions), :mod:`.counters`, :mod:`.calibration` (the planner's
RuntimeCosts measured on the job's process group); for the facade: :mod:`.ownership` (which parameters a rank
updates and counts), :mod:`.handover` (gradients to the optimizer loop, global norm),
:mod:`.fullstate` (full model and optimizer state), :mod:`.fullstate_stream` (the same sent to
rank 0 one tensor at a time, for a checkpoint written as it arrives); for a model built without weights:
:mod:`.materialize` (each rank initialises what it keeps) and :mod:`.pretrained` (or reads it
from safetensors files, tensor by tensor). See ``docs/runtime.md``.
"""

from __future__ import annotations

from lightning_gsched.errors import RuntimeConfigError, RuntimeFault
from lightning_gsched.runtime.calibration import calibrate
from lightning_gsched.runtime.channels import (
    LOST_PEER_GRACE_S,
    Channels,
    FaultNotice,
    default_store,
    destroy_groups,
)
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.executor import ProgramExecutor
from lightning_gsched.runtime.faults import is_timeout, short_reason
from lightning_gsched.runtime.footprint import (
    MeasuredBytes,
    optimizer_factor,
    optimizer_step_factor,
)
from lightning_gsched.runtime.fullstate import parameter_names
from lightning_gsched.runtime.fullstate_stream import StreamedTensor
from lightning_gsched.runtime.layout import StepResult, stage_micros, tie_map
from lightning_gsched.runtime.materialize import (
    DeferredLoadError,
    deferred_parameters,
    initialize,
    initialize_parameters,
    is_deferred,
    owned_parameters,
)
from lightning_gsched.runtime.model_runtime import ModelRuntime, ParameterMemory
from lightning_gsched.runtime.pretrained import (
    PretrainedWeights,
    PretrainedWeightsError,
    load_parameters,
    load_pretrained,
    pretrained_weights,
)
from lightning_gsched.runtime.transport import TRANSPORTS

__all__ = [
    "StreamedTensor",
    "FaultNotice",
    "LOST_PEER_GRACE_S",
    "default_store",
    "destroy_groups",
    "DeferredLoadError",
    "deferred_parameters",
    "initialize",
    "initialize_parameters",
    "is_deferred",
    "owned_parameters",
    "PretrainedWeights",
    "PretrainedWeightsError",
    "load_parameters",
    "load_pretrained",
    "pretrained_weights",
    "is_timeout",
    "short_reason",
    "Channels",
    "MeasuredBytes",
    "ModelRuntime",
    "ParameterMemory",
    "ProgramExecutor",
    "RuntimeConfigError",
    "RuntimeCounters",
    "RuntimeFault",
    "StepResult",
    "TRANSPORTS",
    "optimizer_factor",
    "optimizer_step_factor",
    "parameter_names",
    "calibrate",
    "stage_micros",
    "tie_map",
]
