"""The engine both front ends share: one run's pipeline, with no Lightning in it.

``PipelineEngine`` (:mod:`.engine`) probes the first batch, partitions the model, builds the
runtime's ``ModelRuntime`` and runs training and forward-only evaluation steps; the Trainer
strategy (``lightning_gsched.lightning``) and the Fabric strategy (``lightning_gsched.fabric``)
are thin adapters over it. Nothing here imports the ``lightning`` pip package, so importing the
Fabric front end never loads ``lightning.pytorch`` nor registers Trainer strategies.

Modules, one job each: :mod:`.options` (the arguments both front ends take), :mod:`.config`
(arguments -> plans), :mod:`.rows` (the batch semantics: which rows make each microbatch),
:mod:`.batches` (rows moved to the ranks that read them), :mod:`.intercept` (running
the user's step around the model's call), :mod:`.logsync` (losses and logged values),
:mod:`.auto` (``schedule="auto"`` decided at the first batch), :mod:`.memory_report`
(predicted and measured bytes), :mod:`.control` (the strategy's own bounded collectives),
:mod:`.preemption` (a signal agreed by every rank at a step's exchange),
:mod:`.checkpoint` (the checkpoint service: every save and load of both front ends; its
mechanisms in :mod:`.checkpoint_files`, :mod:`.checkpoint_sharded` and
:mod:`.checkpoint_check`), :mod:`.engine` (the one run's pipeline, with its build's cut in
:mod:`.cut`, its start-up text in :mod:`.startup`, and the rank-0 decisions in
:mod:`.rank_zero`).

The front ends import this face only (``__all__``: what they use), never an engine submodule
(``tests/test_layering.py``).
"""

from __future__ import annotations

from lightning_gsched.engine.checkpoint import (
    CheckpointService,
    CheckpointSettings,
    CheckpointView,
)
from lightning_gsched.engine.checkpoint_check import FABRIC, TRAINER
from lightning_gsched.engine.checkpoint_files import StreamStats
from lightning_gsched.engine.control import ControlGroup, UncaughtExitReport
from lightning_gsched.engine.engine import PipelineEngine, engine_holding
from lightning_gsched.engine.intercept import StepCaller
from lightning_gsched.engine.logsync import replay
from lightning_gsched.engine.memory_report import MemoryReport
from lightning_gsched.engine.mesh import DeviceMeshSlot
from lightning_gsched.engine.options import (
    check_launch_arguments,
    check_transport,
    library_names,
    pipeline_keywords,
    pipeline_options,
    sampler_kwargs,
    tensor_parallel_options,
)
from lightning_gsched.engine.preemption import PreemptionAgreement, PreemptionNotice, signal_name

__all__ = [
    "FABRIC",
    "TRAINER",
    "CheckpointService",
    "CheckpointSettings",
    "CheckpointView",
    "ControlGroup",
    "UncaughtExitReport",
    "DeviceMeshSlot",
    "MemoryReport",
    "PipelineEngine",
    "PreemptionAgreement",
    "PreemptionNotice",
    "StepCaller",
    "StreamStats",
    "check_launch_arguments",
    "check_transport",
    "engine_holding",
    "library_names",
    "pipeline_keywords",
    "pipeline_options",
    "replay",
    "sampler_kwargs",
    "tensor_parallel_options",
    "signal_name",
]
