"""Execute planned programs over torch.distributed: one rank, one program, one step at a time.

:class:`ProgramExecutor` runs one rank's program of ``plan(...).programs`` on ``partition(...)``'s
stages; front ends use the facade :class:`ModelRuntime` and the names here. See docs/runtime.md.
"""

from __future__ import annotations

from lightning_gsched.runtime.aligned_rng import align_generators
from lightning_gsched.runtime.calibration import calibrate
from lightning_gsched.runtime.channels import (
    LOST_PEER_GRACE_S,
    FaultNotice,
    default_store,
    destroy_groups,
)
from lightning_gsched.runtime.executor import ProgramExecutor
from lightning_gsched.runtime.faults import is_timeout, release_frames, short_reason
from lightning_gsched.runtime.footprint import optimizer_factor, optimizer_step_factor
from lightning_gsched.runtime.fullstate import StreamedTensor, parameter_names
from lightning_gsched.runtime.gloo_groups import (
    default_is_gloo,
    gloo_group,
    lightning_reduce,
    mesh_backend,
    mesh_backend_override,
    new_group,
)
from lightning_gsched.runtime.layout import StepResult, stage_micros, tie_map
from lightning_gsched.runtime.materialize import (
    Piece,
    Pieces,
    allocate_parameters,
    deferred_parameters,
    initialize_parameters,
    is_deferred,
    owned_parameters,
    parameters_to_meta,
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
    "align_generators",
    "LOST_PEER_GRACE_S", "FaultNotice", "default_store", "destroy_groups", "is_timeout",
    "release_frames", "short_reason", "TRANSPORTS", "calibrate", "ProgramExecutor", "StepResult",
    "stage_micros", "tie_map", "ModelRuntime", "ParameterMemory", "StreamedTensor",
    "parameter_names", "optimizer_factor", "optimizer_step_factor", "deferred_parameters",
    "initialize_parameters", "allocate_parameters", "parameters_to_meta", "Piece", "Pieces", "is_deferred", "owned_parameters", "PretrainedWeights",
    "PretrainedWeightsError", "load_parameters", "load_pretrained", "pretrained_weights",
    "default_is_gloo", "gloo_group", "lightning_reduce", "mesh_backend", "mesh_backend_override", "new_group",
]
