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

Training front ends use the facade :class:`ModelRuntime` (:mod:`.model_runtime`); this package
exports what they and the engine use (tests import the submodules). See ``docs/runtime.md``.
"""

from __future__ import annotations

from lightning_gsched.runtime.calibration import calibrate
from lightning_gsched.runtime.channels import (
    LOST_PEER_GRACE_S,
    FaultNotice,
    default_store,
    destroy_groups,
)
from lightning_gsched.runtime.executor import ProgramExecutor
from lightning_gsched.runtime.faults import is_timeout, short_reason
from lightning_gsched.runtime.footprint import optimizer_factor, optimizer_step_factor
from lightning_gsched.runtime.fullstate import StreamedTensor, parameter_names
from lightning_gsched.runtime.layout import StepResult, stage_micros, tie_map
from lightning_gsched.runtime.materialize import (
    deferred_parameters,
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
    "LOST_PEER_GRACE_S", "FaultNotice", "default_store", "destroy_groups", "is_timeout",
    "short_reason", "TRANSPORTS", "calibrate", "ProgramExecutor", "StepResult", "stage_micros",
    "tie_map", "ModelRuntime", "ParameterMemory", "StreamedTensor", "parameter_names",
    "optimizer_factor", "optimizer_step_factor", "deferred_parameters", "initialize_parameters",
    "is_deferred", "owned_parameters", "PretrainedWeights", "PretrainedWeightsError",
    "load_parameters", "load_pretrained", "pretrained_weights",
]
