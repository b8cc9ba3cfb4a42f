"""Per-unit costs for the ``"params"`` and ``"time"`` balance modes.

``"params"``: the number of parameter elements a unit reads. A parameter read by two units (a tied
embedding used again as the output projection, a layer called twice) counts for each: it is
memory in both stages and work in both. Deterministic, so every rank computes the same split.

``"time"``: forward + backward wall time of each unit on the example input, median of a few
repeats, in integer nanoseconds. Timings differ between processes, so in a multi-process job
rank 0 must measure and the others must reuse its numbers (``partition(..., unit_costs=...)``;
the strategy broadcasts ``part.unit_costs`` from rank 0). Profiling never writes ``.grad``
(it uses ``torch.autograd.grad``) and runs inside the example pass, which restores buffers
and RNG state afterwards.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_gsched.partition.units import Unit

DEFAULT_REPEATS = 3


def parameter_costs(units: list[Unit]) -> list[int]:
    return [unit.param_elements for unit in units]


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare(args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor], torch.device | None]:
    """Fresh grad-requiring copies of floating activations; parameters are passed as they are."""
    grad_inputs: list[torch.Tensor] = []
    device: list[torch.device] = []

    def fresh(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        device.append(value.device)
        if isinstance(value, nn.Parameter):
            if value.requires_grad:
                grad_inputs.append(value)
            return value
        if value.is_floating_point() or value.is_complex():
            leaf = value.detach().clone().requires_grad_(True)
            grad_inputs.append(leaf)
            return leaf.clone()  # non-leaf, so in-place units work
        return value

    new_args, new_kwargs = pytree.tree_map(fresh, (args, kwargs))
    return new_args, new_kwargs, grad_inputs, (device[0] if device else None)


def _time_once(call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               extra: Sequence[torch.Tensor]) -> int:
    run_args, run_kwargs, grad_inputs, device = _prepare(args, kwargs)
    grad_inputs += [p for p in extra if p.requires_grad]
    _synchronize(device)
    start = time.perf_counter_ns()
    out = call(*run_args, **run_kwargs)
    _synchronize(device)
    forward_ns = time.perf_counter_ns() - start
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs or not grad_inputs:
        return forward_ns
    grads = [torch.ones_like(t) for t in outputs]
    start = time.perf_counter_ns()
    torch.autograd.grad(outputs, grad_inputs, grads, allow_unused=True)
    _synchronize(device)
    return forward_ns + time.perf_counter_ns() - start


class TimeProfiler:
    """A :data:`~.execute.UnitHook` that records each unit's forward+backward time."""

    def __init__(self, num_units: int, repeats: int = DEFAULT_REPEATS) -> None:
        self.repeats = repeats
        self.costs: list[int] = [0] * num_units

    def __call__(self, unit: Unit, call: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        extra = list(call.parameters()) if isinstance(call, nn.Module) else []
        samples: list[int] = []
        with torch.enable_grad():
            for attempt in range(self.repeats + 1):  # first run warms caches, not counted
                try:
                    elapsed = _time_once(call, args, kwargs, extra)
                except Exception:  # noqa: BLE001 - e.g. non-differentiable: time forward only
                    elapsed = self._forward_only(call, args, kwargs)
                if attempt:
                    samples.append(elapsed)
        self.costs[unit.index] = int(statistics.median(samples))

    @staticmethod
    def _forward_only(call: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> int:
        run_args, run_kwargs, _, device = _prepare(args, kwargs)
        with torch.no_grad():
            start = time.perf_counter_ns()
            call(*run_args, **run_kwargs)
            _synchronize(device)
            return time.perf_counter_ns() - start
