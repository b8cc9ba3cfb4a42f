"""Peak bytes of one training step as the torch profiler sees the allocations, not the runtime.

Why: the ``memory[...]`` rows used to compare the planner's prediction with the runtime's own
accounting of its tensors (``runtime/footprint.py``), which counts the categories the planner
predicts by construction. Here the measurement comes from outside the runtime: the torch
profiler (``profile_memory=True``) records every CPU allocation and free during the step, and
its memory profile (the machinery behind ``export_memory_timeline``) adds the tensors that
existed before the step (weights, gradients, optimizer state) when the step touches them. The
peak of their sum over the step is what the allocator held for tensors; its categories
(parameter, optimizer state, gradient, activation, autograd detail, input, temporary) are the
profiler's own, not ours. Reads torch internals (``prof._memory_profile()``,
``MemoryProfileTimeline._coalesce_timeline``) of torch 2.13.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def timeline_peak(prof: Any) -> dict[str, Any]:
    """``{"total": peak bytes, "at_peak": {category: bytes}}`` of a finished CPU profile, or
    ``{"error": text}`` where torch's analysis of the step fails (its data-flow pass asserts on
    some steps: "version mismatch")."""
    import torch
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    try:
        timeline = MemoryProfileTimeline(prof._memory_profile())
    except AssertionError as exc:
        return {"error": f"torch's memory profile failed: {str(exc)[:80]}"}
    _, sizes = timeline._coalesce_timeline(torch.device("cpu"))
    totals = [sum(row) for row in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    # column 0 is torch's own spare slot; a category's column is its index + 1
    names = {i + 1: "unknown" if c is None else c.name.lower()
             for c, i in _CATEGORY_TO_INDEX.items()}
    at_peak = {names.get(i, "other"): int(b) for i, b in enumerate(sizes[at]) if b}
    return {"total": int(totals[at]), "at_peak": at_peak}


class ProfilerPeak(pl.Callback):
    """Profile the allocations of one training batch (``batch``) and keep :func:`timeline_peak`."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.peak: dict[str, Any] | None = None
        self._prof: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                 record_shapes=True, with_stack=True)
            self._prof.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx == self.batch and self._prof is not None:
            self._prof.__exit__(None, None, None)
            self.peak = timeline_peak(self._prof)
            self._prof = None
