"""Measuring a split model: the stages timed and sized on one real microbatch, for the planner.

    from lightning_gsched.measure import measure_stage_bytes, profile_stages, tune_model
    times = profile_stages(part.stages, (x,), loss_fn=loss_fn)    # seconds per stage
    sizes = measure_stage_bytes(part.stages, (x,), loss_fn=loss_fn)  # bytes per stage

Why a package of its own: measuring needs both the partitioner (stages to run) and the runtime
(its split backward, its wire format, its byte counters and parameter layout), so that the
numbers are those of the code that will run. It sits above both; ``partition/`` then depends on
nothing in ``runtime/``.

Modules: :mod:`.stage_pass` (``measure_stages``: the one measuring pass, each stage visited once
for every figure asked for; ``profile_stages`` and ``measure_stage_bytes`` are that pass for
seconds alone or bytes alone), :mod:`.profile` (one stage's timed runs: forward/backward
seconds, B and W apart), :mod:`.measure_bytes` (one stage's byte run: parameter, gradient,
optimizer, stashed-activation and message bytes, for ``schedule/memory.py``),
:mod:`.tune_profile` (``stage_profile`` per stage count and ``tune_model``: the measured side of
``gsched tune`` and of ``GeneralParallel("auto")``).
"""

from __future__ import annotations

from lightning_gsched.measure.profile import StageTimes
from lightning_gsched.measure.stage_pass import (
    StageMeasurement,
    measure_stage_bytes,
    measure_stages,
    profile_stages,
)
from lightning_gsched.measure.tune_profile import stage_profile, tune_model

__all__ = ["StageMeasurement", "StageTimes", "measure_stage_bytes", "measure_stages",
           "profile_stages", "stage_profile", "tune_model"]
