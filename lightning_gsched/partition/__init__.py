"""Split any torch.fx-traceable model into balanced pipeline stages, without rewriting it.

    from lightning_gsched.partition import partition
    part = partition(module, num_stages, example_args=(x,), balance="params")
    part.stages            # list of StageModule (nn.Module), len == num_stages
    part(*args, **kwargs)  # the stages in sequence on one process == module(*args, **kwargs)
    part.shared_parameters # {canonical fqn: [stage indices]} for tied weights
    print(part.report())

Stage contract: ``stages[0](*args, **kwargs)`` takes the original call; ``stages[k](carried)``
takes the single tuple returned by stage ``k - 1``; the last stage returns exactly what
``module.forward`` returns. Stages hold the original modules and parameters (no copies) under
their original fully qualified names. See :mod:`.stage` and ``docs/partition.md``.

Modules, one job each: :mod:`.layout` (call signature <-> flat graph inputs/outputs),
:mod:`.tracer` (fx tracing, leaves, trace errors), :mod:`.attempts` (symbolic, then static
shapes: the order of tracing modes), :mod:`.balance_check` (warn about a degenerate split),
:mod:`.hints` (what to say about a leaf in the way), :mod:`.preserve` (undo side effects),
:mod:`.units` (cuttable units, liveness), :mod:`.execute` (example run), :mod:`.costs`
(params / time), :mod:`.linear` (DP), :mod:`.cuts` (choosing cuts), :mod:`.stage`
(StageModule), :mod:`.api` (``partition``, ``Partition``), :mod:`.report`. Timing and sizing
the stages (``profile_stages``, ``measure_stage_bytes``) is ``lightning_gsched.measure``, above
this package and the runtime; nothing here imports the runtime.
"""

from __future__ import annotations

from lightning_gsched.partition.api import Partition, partition
from lightning_gsched.partition.errors import (
    BalanceError,
    ExampleInputError,
    ModeMismatchError,
    PartitionError,
    SplitMismatchError,
    StageInputError,
    TooManyStagesError,
    TraceFailedError,
    UnbalancedPartitionWarning,
    UnknownNameError,
    UntracedOutputError,
)
from lightning_gsched.partition.stage import StageModule

__all__ = [
    "BalanceError",
    "ExampleInputError",
    "SplitMismatchError",
    "UntracedOutputError",
    "ModeMismatchError",
    "Partition",
    "PartitionError",
    "StageInputError",
    "StageModule",
    "TooManyStagesError",
    "TraceFailedError",
    "UnbalancedPartitionWarning",
    "UnknownNameError",
    "partition",
]
