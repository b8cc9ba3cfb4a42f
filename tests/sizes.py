"""Equal stage sizes for the planner's byte tests (no model measured)."""

from __future__ import annotations

from typing import Mapping

from lightning_gsched.schedule.memory import ModelSizes, StageSizes, TieSizes


def uniform_sizes(stages: int, params: int, activations: int, message: int,
                  optimizer_factor: float = 0.0,
                  ties: Mapping[int, tuple[int, ...]] | None = None,
                  tie_params: int = 0) -> ModelSizes:
    """Equal stages (for planning before anything is measured, and for tests): gradients the
    size of the weights, optimizer state ``optimizer_factor`` times the weights; every tie of
    ``ties`` (``{home: readers}``, as ``plan().ties``) ``tie_params`` bytes, sized alike."""
    stage = StageSizes(params, params, int(params * optimizer_factor), activations, message,
                       inputs=message)
    tie = {h: TieSizes(tuple(r), tie_params, tie_params, int(tie_params * optimizer_factor))
           for h, r in (ties or {}).items()}
    return ModelSizes(tuple(stage for _ in range(stages)), tie)
