"""Run the user's step method on one microbatch, with ``self(...)`` intercepted.

Why: the user's ``training_step`` (and validation/test/predict steps) stay unchanged. The
strategy calls the step twice per microbatch, on different ranks:

* capture (on the rank that computes stage 0): ``self(...)`` records its arguments and stops the
  step right there, so the pipeline gets the model's input without running any of the model;
* finish (on the rank that computes the last stage, inside the executor): ``self(...)`` returns
  the pipeline's output instead of running the model, and the rest of the step computes the loss.

``self.log`` calls made while finishing are recorded (with the microbatch) instead of going to
Lightning: the strategy reduces them over microbatches and ranks and logs each value once, the
same on every rank. During capture they are dropped (the finishing run logs them).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch import LightningModule

from lightning_gsched.errors import TrainingStepError


class _Captured(Exception):
    """Raised by the intercepted ``forward`` to leave the user's step after ``self(...)``."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("captured")
        self.args, self.kwargs = args, kwargs


@dataclass
class LogRecord:
    """One ``self.log(name, value, **options)`` call made on microbatch ``micro``."""

    micro: int
    name: str
    value: float
    options: dict[str, Any]


@dataclass
class ProbeResult:
    """What the probe saw: the arguments of the one ``self(...)`` call and the step's result."""

    args: tuple
    kwargs: dict
    result: Any


@dataclass
class StepCaller:
    """Calls ``module.<hook>(microbatch, *rest)`` in capture or finish mode (see module doc)."""

    module: LightningModule
    hook: str  # "training_step", "validation_step", ...
    rest: tuple = ()
    kwargs: dict = field(default_factory=dict)
    logs: list[LogRecord] = field(default_factory=list)

    @contextmanager
    def _patched(self, forward: Callable, log: Callable) -> Iterator[None]:
        module = self.module
        had_forward, had_log = "forward" in vars(module), "log" in vars(module)
        old_forward, old_log = vars(module).get("forward"), vars(module).get("log")
        module.forward = forward  # type: ignore[method-assign]
        module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            for name, had, old in (("forward", had_forward, old_forward), ("log", had_log, old_log)):
                if had:
                    setattr(module, name, old)
                else:
                    delattr(module, name)

    def capture(self, micro_batch: Any) -> tuple[tuple, dict]:
        """The ``(args, kwargs)`` the step passes to ``self(...)`` for this microbatch."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            raise _Captured(args, kwargs)

        with self._patched(forward, _drop_log):
            try:
                getattr(self.module, self.hook)(micro_batch, *self.rest, **self.kwargs)
            except _Captured as call:
                return call.args, call.kwargs
        raise TrainingStepError(self._never())

    def probe(self, micro_batch: Any) -> "ProbeResult":
        """Run the whole step with the real forward, checking it calls ``self(...)`` once.

        Used once per run on every rank (same data everywhere, so every rank reaches the same
        verdict); logging is dropped. The caller preserves RNG and buffers around it.
        """
        real = type(self.module).forward.__get__(self.module)
        calls: list[tuple[tuple, dict]] = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append((args, kwargs))
            if len(calls) > 1:
                raise TrainingStepError(self._twice())
            return real(*args, **kwargs)

        with self._patched(forward, _drop_log):
            result = getattr(self.module, self.hook)(micro_batch, *self.rest, **self.kwargs)
        if not calls:
            raise TrainingStepError(self._never())
        return ProbeResult(calls[0][0], calls[0][1], result)

    def _never(self) -> str:
        return (
            f"{type(self.module).__name__}.{self.hook} never calls self(...). GeneralParallel "
            "pipelines the module's forward(), so the step must call it exactly once, e.g. "
            "`out = self(x)` (not `self.model(x)`: move that call into forward())"
        )

    def _twice(self) -> str:
        return (
            f"{type(self.module).__name__}.{self.hook} calls self(...) more than once; "
            "GeneralParallel pipelines one forward per step. Call self(...) once (e.g. on "
            "concatenated inputs) and split its output"
        )

    def finish(self, micro_batch: Any, output: Any, micro: int) -> Any:
        """Run the step with ``self(...)`` returning ``output``; returns the step's result."""
        calls = 0

        def forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise TrainingStepError(self._twice())
            return output

        def log(name: str, value: Any, *args: Any, **options: Any) -> None:
            if args:
                raise TrainingStepError(
                    f"self.log({name!r}, ...) got positional options; pass them by keyword "
                    "(prog_bar=True, ...) so GeneralParallel can replay them"
                )
            self.logs.append(LogRecord(micro, name, _to_float(name, value), options))

        with self._patched(forward, log):
            return getattr(self.module, self.hook)(micro_batch, *self.rest, **self.kwargs)


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during capture: the finishing run on the last-stage rank logs instead."""


def _to_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TrainingStepError(
                f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log scalars"
            )
        return float(value.detach().float().item())
    if isinstance(value, (int, float, bool)):
        return float(value)
    raise TrainingStepError(
        f"self.log({name!r}) got a {type(value).__name__}; under GeneralParallel log tensors or "
        "numbers (for a torchmetrics Metric, log metric.compute() at epoch end)"
    )


def step_loss(result: Any, hook: str) -> torch.Tensor:
    """The loss a training step returned (a tensor, or a dict with 'loss')."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, torch.Tensor):
        raise TrainingStepError(
            f"{hook} returned {type(result).__name__}; under GeneralParallel it must return the "
            "loss tensor (or a dict with 'loss'). Skipping a step by returning None is not "
            "supported: the step's microbatches run on several ranks"
        )
    return loss
