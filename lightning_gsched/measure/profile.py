"""Measured forward and backward time of each stage, in seconds, for the planner's costs.

Why: the planner's timeline is only as good as its per-stage costs. The defaults (forward 1,
backward 2 per stage) give the right *shape* of a schedule, but predicting a step time in
seconds, or planning around a heavy last stage (a vocabulary projection plus the loss), needs
the stages' real durations on the real microbatch. ``profile_stages`` runs the stages one after
another on one microbatch, exactly as a pipeline would (each stage fed the previous stage's
output), and times each stage's forward and its backward separately; pass the result to
``plan(forward_cost=..., backward_cost=...)`` or ``GeneralParallel(forward_cost=...,
backward_cost=...)``.

Zero-bubble schedules split every backward into B (input gradients, on the critical path) and W
(weight gradients, later). Their plans need both durations, and halving a measured backward is
wrong wherever the two halves differ (a first stage fed token ids has no input gradient at all:
its B is nearly free and its W is the whole backward). ``split_backward=True`` times B and W with
the runtime's own split (:mod:`lightning_gsched.runtime.split_backward`), so the profiled costs
are those of the code that will run; pass ``weight_cost=times.weight`` beside the others.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.errors import GschedError, PartitionError
from lightning_gsched.partition.errors import ExampleInputError
from lightning_gsched.partition.execute import describe_values
from lightning_gsched.partition.stage import StageModule
from lightning_gsched.runtime.split_backward import backward_input


@dataclass
class StageTimes:
    """Median seconds per stage; ``forward[-1]`` includes the loss when one was given.

    With ``profile_stages(..., split_backward=True)``, ``backward`` is B's share (the input
    gradients) and ``weight`` W's (the weight gradients); otherwise ``weight`` is empty and
    ``backward`` is the whole backward.
    """

    forward: list[float]
    backward: list[float]
    weight: list[float] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.forward) + sum(self.backward) + sum(self.weight)

    def plan_costs(self) -> dict[str, list[float]]:
        """``plan()``'s cost arguments: ``plan(..., **times.plan_costs())``."""
        costs = {"forward_cost": self.forward, "backward_cost": self.backward}
        if self.weight:
            costs["weight_cost"] = self.weight
        return costs


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """A stage's inputs as new leaves that require grad (floating tensors only)."""
    leaves: list[torch.Tensor] = []

    def make(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            leaf = x.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf
        return x

    return pytree.tree_map(make, value), leaves


def profile_stages(stages: Sequence[torch.nn.Module], args: tuple[Any, ...],
                   kwargs: dict[str, Any] | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 5,
                   warmup: int = 2, split_backward: bool = False) -> StageTimes:
    """Time each stage's forward and backward on one microbatch (``args``/``kwargs``).

    ``stages``: a :class:`~lightning_gsched.partition.Partition`'s ``stages``. ``loss_fn`` maps
    the last stage's output to the scalar the backward starts from (the step's loss; without
    it the output's sum is used). The backward of a stage is timed from the gradient of its
    outputs (random, the shape a pipeline would receive) to the gradients of its inputs and
    parameters. Medians over ``repeats`` runs after ``warmup`` runs. ``split_backward``: time
    the backward as the zero-bubble runtime runs it, B (input gradients) then W (weight
    gradients), reported as ``backward`` and ``weight``.
    """
    if not stages:
        raise PartitionError("profile_stages needs at least one stage")
    kwargs = kwargs or {}
    forward: list[list[float]] = [[] for _ in stages]
    backward: list[list[float]] = [[] for _ in stages]
    weight: list[list[float]] = [[] for _ in stages]
    device = next((t.device for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)), None)
    with torch.enable_grad():
        for attempt in range(warmup + repeats):
            value: Any = None
            for s, stage in enumerate(stages):
                leaves: list[torch.Tensor] = []
                if s == 0:
                    call_args, call_kwargs = args, kwargs
                else:
                    fresh, leaves = _fresh(value)
                    call_args, call_kwargs = (fresh,), {}
                _sync(device)
                start = time.perf_counter()
                out = run_stage(stage, s, len(stages), call_args, call_kwargs)
                if s == len(stages) - 1:
                    out = run_loss(loss_fn, out) if loss_fn is not None else sum(
                        t.float().sum() for t in pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor) and t.is_floating_point())
                _sync(device)
                elapsed_f = time.perf_counter() - start
                tensors = [t for t in pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor) and t.requires_grad]
                grads = [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t)
                         for t in tensors]
                if split_backward:
                    elapsed_b, elapsed_w = _split_backward(stage, tensors, grads, leaves, device)
                else:
                    _sync(device)
                    start = time.perf_counter()
                    if tensors:
                        torch.autograd.backward(tensors, grads)
                    _sync(device)
                    elapsed_b, elapsed_w = time.perf_counter() - start, 0.0
                if attempt >= warmup:
                    forward[s].append(elapsed_f)
                    backward[s].append(elapsed_b)
                    weight[s].append(elapsed_w)
                value = pytree.tree_map(
                    lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            for stage in stages:
                stage.zero_grad(set_to_none=True)
    return StageTimes([statistics.median(v) for v in forward],
                      [statistics.median(v) for v in backward],
                      [statistics.median(v) for v in weight] if split_backward else [])


def _split_backward(stage: torch.nn.Module, roots: list[torch.Tensor], grads: list[torch.Tensor],
                    inputs: list[torch.Tensor], device: torch.device | None) -> tuple[float, float]:
    """Seconds of B (input gradients) and of W (weight gradients), run as the runtime runs them."""
    _sync(device)
    start = time.perf_counter()
    if roots:
        _, pending = backward_input(roots, grads, inputs, stage.parameters())
    _sync(device)
    elapsed_b = time.perf_counter() - start
    start = time.perf_counter()
    if roots:
        pending.run()
    _sync(device)
    return elapsed_b, time.perf_counter() - start


def run_stage(stage: torch.nn.Module, index: int, count: int, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    """``stage(*args, **kwargs)``; a failure names the stage and its unit (not torch internals)."""
    try:
        return stage(*args, **kwargs)
    except GschedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the model on the given input
        unit = stage.failing_unit(exc) if isinstance(stage, StageModule) else None
        at = f" at {unit}" if unit else ""
        raise ExampleInputError(
            f"profile_stages: stage {index} of {count} failed{at} with {type(exc).__name__}: "
            f"{exc} (stage inputs: {describe_values((args, kwargs))}). args/kwargs must be one "
            "microbatch as one call of the model's forward, shaped like the partition's example, "
            "e.g. profile_stages(part.stages, (x,))"
        ) from exc


def run_loss(loss_fn: Callable[[Any], torch.Tensor], output: Any) -> torch.Tensor:
    """The user's ``loss_fn(output)``; a failure says it was the loss, not a stage."""
    try:
        return loss_fn(output)
    except GschedError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure inside the user's loss_fn
        raise PartitionError(
            f"profile_stages: loss_fn raised {type(exc).__name__}: {exc} when called with the "
            f"last stage's output ({describe_values(output)}); loss_fn maps that output to the "
            "scalar loss, e.g. loss_fn=lambda out: F.cross_entropy(out, y)"
        ) from exc
