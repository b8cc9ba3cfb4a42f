"""Measured forward and backward time of one stage, in seconds, for the planner's costs.

Why: the planner's timeline is only as good as its per-stage costs. The defaults (forward 1,
backward 2 per stage) give the right *shape* of a schedule, but predicting a step time in
seconds, or planning around a heavy last stage (a vocabulary projection plus the loss), needs
the stages' real durations on the real microbatch. :func:`time_stage` times one stage's
forward and backward on its input as the pipeline hands it over; the loop over the stages, fed
one after another, is the measuring pass (:mod:`.stage_pass`, ``profile_stages``), whose
:class:`StageTimes` go to ``plan(forward_cost=..., backward_cost=...)`` or
``GeneralParallel(forward_cost=..., backward_cost=...)``.

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
from typing import Any, Callable, Literal, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.errors import GschedError, PartitionError
from lightning_gsched.partition.errors import ExampleInputError
from lightning_gsched.partition.execute import describe_values
from lightning_gsched.partition.stage import StageModule
from lightning_gsched.runtime import wire
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


Kind = Literal["whole", "split", "unlossed"]
"""A timed repetition's backward: the whole backward; B then W (the zero-bubble split); or the
whole backward of the last stage without the loss (its outputs summed, as with no ``loss_fn``)."""


@dataclass
class KindSamples:
    """One kind's seconds over its timed repetitions (``weight``: W's, ``split`` only)."""

    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)


StageCall = Callable[[], tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]]
"""A stage's inputs for one run: ``(args, kwargs, leaves)``, fresh leaves each call."""


def time_stage(stage: torch.nn.Module, index: int, count: int, call: StageCall,
               loss_fn: Callable[[Any], torch.Tensor] | None, kinds: Sequence[Kind],
               repeats: int, warmup: int, device: torch.device | None,
               ) -> tuple[dict[Kind, KindSamples], wire.Split | None]:
    """One stage's timed repetitions, no hooks installed: ``warmup`` untimed runs (cycling
    through ``kinds``), then ``repeats`` runs of each kind; and the last run's output as the
    next stage receives it (fresh leaves, no graph; None for the last stage).

    The forward of the last stage includes the loss (``loss_fn``, or the sum of its floating
    outputs without one, or for ``"unlossed"``); a backward starts from the gradient of the
    stage's outputs (random, the shape a pipeline would receive) and ends at its inputs' and
    parameters' gradients. Every run ends with the stage's ``.grad`` set to None (outside the
    timer), so each backward allocates its gradients as the first one of a step does.
    """
    samples: dict[Kind, KindSamples] = {kind: KindSamples() for kind in kinds}
    order = [kinds[i % len(kinds)] for i in range(warmup)] + [
        kind for _ in range(repeats) for kind in kinds]
    last = index == count - 1
    handed: wire.Split | None = None
    for attempt, kind in enumerate(order):
        args, kwargs, leaves = call()
        _sync(device)
        start = time.perf_counter()
        out = run_stage(stage, index, count, args, kwargs)
        if last:
            out = run_loss(loss_fn, out) if loss_fn is not None and kind != "unlossed" else sum(
                t.float().sum() for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.is_floating_point())
        _sync(device)
        elapsed_f = time.perf_counter() - start
        if not last and attempt == len(order) - 1:
            parts = wire.split(out, what=f"output of stage {index}")
            handed = wire.Split(parts.structure, wire.detached_leaves(parts.tensors))
            del parts
        tensors = [t for t in pytree.tree_leaves(out)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in tensors]
        del out
        if kind == "split":
            elapsed_b, elapsed_w = _split_backward(stage, tensors, grads, leaves, device)
        else:
            _sync(device)
            start = time.perf_counter()
            if tensors:
                torch.autograd.backward(tensors, grads)
            _sync(device)
            elapsed_b, elapsed_w = time.perf_counter() - start, 0.0
        stage.zero_grad(set_to_none=True)
        if attempt >= warmup:
            samples[kind].forward.append(elapsed_f)
            samples[kind].backward.append(elapsed_b)
            samples[kind].weight.append(elapsed_w)
    return samples, handed


def median(values: Sequence[float]) -> float:
    """The median of a stage's samples (0.0 for none: a kind that was not timed)."""
    return statistics.median(values) if values else 0.0


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
