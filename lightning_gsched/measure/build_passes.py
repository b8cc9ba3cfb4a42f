"""The measuring passes one build made, kept so that a later consumer need not run them again.

Why: at the first batch, rank 0 measures stages twice over. For ``schedule="auto"`` the tuner
runs one pass per stage count it considers (seconds and bytes, with the user's loss, on the
smallest microbatch any candidate runs); then the memory report sizes the stages the run will
train (bytes without the loss, on the pick's microbatch). Where the report's stages are a cut
the tuner measured, on an equal microbatch, the report's bytes are the tuner's: the loss runs
on the last stage alone, so only that stage is sized again without it
(:func:`~lightning_gsched.measure.stage_pass.sizes_without_loss`). Elsewhere (another cut, or
another microbatch: the pick cuts the batch into fewer microbatches than the probe) the
figures differ and the report runs its own pass, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.measure.stage_pass import (
    StageMeasurement,
    measure_stage_bytes,
    sizes_without_loss,
)
from lightning_gsched.schedule.memory import ModelSizes


@dataclass(frozen=True)
class MeasuredCut:
    """One pass and what it was made on: the cut (each stage's unit names) and the call."""

    stage_units: list[list[str]]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    measurement: StageMeasurement


@dataclass
class BuildPasses:
    """The build's passes with bytes (:meth:`record`), and sizes that reuse them
    (:meth:`stage_bytes`). ``reused``: how many times a recorded pass served the sizes."""

    cuts: list[MeasuredCut] = field(default_factory=list)
    reused: int = 0

    def record(self, stage_units: list[list[str]], args: tuple[Any, ...],
               kwargs: dict[str, Any], measurement: StageMeasurement) -> None:
        """Keep a pass made on the cut ``stage_units`` and the call ``args``/``kwargs``."""
        if measurement.stashes:
            self.cuts.append(MeasuredCut(stage_units, args, kwargs, measurement))

    def clear(self) -> None:
        """Drop the passes (each holds a microbatch's inputs and its last stage's input)."""
        self.cuts.clear()

    def stage_bytes(self, stage_units: list[list[str]], stages: Sequence[torch.nn.Module],
                    args: tuple[Any, ...], kwargs: dict[str, Any],
                    optimizer_factor: float) -> ModelSizes:
        """``measure_stage_bytes(stages, args, kwargs, optimizer_factor=...)`` (no loss), from
        a recorded pass of the same cut on an equal call where there is one."""
        for cut in self.cuts:
            if cut.stage_units == stage_units and same_call((cut.args, cut.kwargs),
                                                            (args, kwargs)):
                self.reused += 1
                return sizes_without_loss(cut.measurement, stages, args, kwargs,
                                          optimizer_factor)
        return measure_stage_bytes(stages, args, kwargs, optimizer_factor=optimizer_factor)


def same_call(a: Any, b: Any) -> bool:
    """Two model calls with the same structure and equal leaves (tensors: dtype, shape,
    device and values; meta tensors are never equal: they have no values)."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    return all(_same_leaf(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))


def _same_leaf(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return False
        if x.is_meta or y.is_meta or (x.dtype, x.shape, x.device) != (y.dtype, y.shape,
                                                                      y.device):
            return False
        return bool(torch.equal(x, y))
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # noqa: BLE001 - a value that cannot say it is equal is not
        return False
