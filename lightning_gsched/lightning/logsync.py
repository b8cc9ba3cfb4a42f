"""Reduce what the microbatch steps logged and the losses, once per step, over all ranks.

Why: each microbatch's step finishes on the rank that computes the last stage, so a value logged
there exists on one rank only. Lightning expects every rank to make the same ``self.log`` calls
(``sync_dist`` is a collective per call, and ``ModelCheckpoint(monitor=...)``/``EarlyStopping``
read the value on every rank). One object all-gather per step brings every microbatch's records
and loss to every rank; each name is then reduced over the global batch the way a single device
would have seen it, and logged with the user's options on every rank.

Reduction over microbatches: ``reduce_fx`` "mean" (the default) takes the row-weighted mean (the
value of a per-row average on the whole batch), "sum" the sum, "max"/"min" the extremes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_gsched.errors import TrainingStepError
from lightning_gsched.lightning.intercept import LogRecord

_FX_NAMES = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_FX_FUNCS: dict[Callable, str] = {torch.mean: "mean", torch.sum: "sum", torch.max: "max",
                                  torch.min: "min"}


def exchange(payload: Any, world_size: int) -> list[Any]:
    """Every rank's ``payload``, in rank order (one collective)."""
    if world_size == 1:
        return [payload]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, payload)
    return gathered


def _fx_kind(name: str, fx: Any) -> str:
    if isinstance(fx, str) and fx.lower() in _FX_NAMES:
        return _FX_NAMES[fx.lower()]
    if fx in _FX_FUNCS:
        return _FX_FUNCS[fx]
    raise TrainingStepError(
        f"self.log({name!r}, reduce_fx={fx!r}): GeneralParallel combines microbatches with "
        "'mean', 'sum', 'max' or 'min' only"
    )


def reduce_records(records: list[LogRecord], weights: list[int]) -> list[tuple[str, float, dict]]:
    """(name, value, options) per logged name, in first-logged order (see module docstring)."""
    by_name: dict[str, list[LogRecord]] = {}
    for record in sorted(records, key=lambda r: r.micro):
        by_name.setdefault(record.name, []).append(record)
    out = []
    for name, group in by_name.items():
        options = group[0].options
        kind = _fx_kind(name, options.get("reduce_fx", "mean"))
        values = [r.value for r in group]
        if kind == "mean":
            pairs = [(r.value, weights[r.micro]) for r in group if weights[r.micro] > 0]
            total = sum(w for _, w in pairs)
            value = (sum(v * w for v, w in pairs) / total if total
                     else sum(values) / len(values))
        elif kind == "sum":
            value = sum(values)
        elif kind == "max":
            value = max(values)
        else:
            value = min(values)
        out.append((name, value, options))
    return out


def replay(module: Any, reduced: list[tuple[str, float, dict]], device: torch.device,
           batch_size: int) -> None:
    """Log the reduced values through Lightning, identically on every rank."""
    for name, value, options in reduced:
        options = dict(options)
        options.setdefault("batch_size", batch_size)
        module.log(name, torch.tensor(value, device=device), **options)
