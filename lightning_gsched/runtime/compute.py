"""Forward and backward of one stage on one microbatch, and the stash between them.

Why cut every boundary: each ``B s b`` of a program is a separate action (possibly hours of
other actions apart, with the stage's weights freed and refetched in between), so a stage's
backward must cover that stage only. Stage inputs are therefore always fresh leaves (received,
or detached from the local producer), and the backward of stage ``s`` is
``autograd.backward(outputs of F s b, gradients of those outputs)``, after which the inputs'
``.grad`` are the gradients to hand to stage ``s - 1``.

The last stage's backward starts from ``loss_fn(output, b) / B``: with the global batch split
into B microbatches, the summed gradients equal one step on the mean loss of the global batch.

Forward-only runs (validation, test, predict) use :meth:`StageCompute.infer`: no graph, no stash.

``forward_context`` (optional) is entered around every stage's forward call, and only there: a
front end's precision (autocast, a default dtype) then applies to the model's computation as it
does for ``model(x)`` on one device, not to the loss code after the model or to the backward.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime import wire

LossFn = Callable[[Any, int], torch.Tensor]
ForwardContext = Callable[[], AbstractContextManager]


@dataclass
class Stashed:
    """What ``B s b`` needs from ``F s b``: the graph's roots and the input leaves."""

    inputs: list[torch.Tensor]  # stage inputs (fresh leaves); their .grad is the input-gradient
    outputs: list[torch.Tensor] = field(default_factory=list)  # non-last stage: output tensors
    loss: torch.Tensor | None = None  # last stage: loss / B


class StageCompute:
    """Runs stages and keeps the stash; knows nothing about ranks or messages."""

    def __init__(self, stages: Sequence[nn.Module], num_micro: int,
                 forward_context: ForwardContext | None = None) -> None:
        self.stages = list(stages)
        self.forward_context: ForwardContext = forward_context or nullcontext
        self.last = len(self.stages) - 1
        self.num_micro = num_micro
        self.stash: dict[tuple[int, int], Stashed] = {}
        # when a dict: seconds of every forward / backward, keyed ("F" | "B", stage); the
        # in-run profile that predict_step_time can replay (ProgramExecutor.compute_times)
        self.times: dict[tuple[str, int], list[float]] | None = None

    def forward(
        self,
        s: int,
        b: int,
        args: tuple,
        kwargs: dict,
        in_leaves: list[torch.Tensor],
        loss_fn: LossFn,
    ) -> tuple[wire.Split | None, torch.Tensor | None]:
        """Run ``F s b``; returns (output split for the next stage, unscaled loss on the last)."""
        if self.times is None:
            return self._forward(s, b, args, kwargs, in_leaves, loss_fn)
        start = time.perf_counter()
        try:
            return self._forward(s, b, args, kwargs, in_leaves, loss_fn)
        finally:
            self.times.setdefault(("F", s), []).append(time.perf_counter() - start)

    def _forward(self, s: int, b: int, args: tuple, kwargs: dict, in_leaves: list[torch.Tensor],
                 loss_fn: LossFn) -> tuple[wire.Split | None, torch.Tensor | None]:
        with torch.enable_grad():
            with self.forward_context():
                output = self.stages[s](*args, **kwargs)
            if s == self.last:
                loss = loss_fn(output, b)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise RuntimeConfigError(
                        f"loss_fn(output, {b}) must return a scalar tensor, got {_describe(loss)}; "
                        "reduce the loss (e.g. .mean()) inside loss_fn."
                    )
                self.stash[(s, b)] = Stashed(in_leaves, loss=loss.reshape(()) / self.num_micro)
                return None, loss.detach()
        parts = wire.split(output, what=f"output of stage {s}")
        self.stash[(s, b)] = Stashed(in_leaves, outputs=parts.tensors)
        return parts, None

    def infer(self, s: int, args: tuple, kwargs: dict) -> Any:
        """Forward of stage ``s`` without autograd and without stashing (forward-only runs)."""
        with torch.no_grad(), self.forward_context():
            return self.stages[s](*args, **kwargs)

    def backward(self, s: int, b: int, out_grads: Sequence[Any] | None) -> list[Any]:
        """Run ``B s b``; returns the gradients of the stage's input tensors (None where none)."""
        if self.times is None:
            return self._backward(s, b, out_grads)
        start = time.perf_counter()
        try:
            return self._backward(s, b, out_grads)
        finally:
            self.times.setdefault(("B", s), []).append(time.perf_counter() - start)

    def _backward(self, s: int, b: int, out_grads: Sequence[Any] | None) -> list[Any]:
        stashed = self.stash.pop((s, b))
        if stashed.loss is not None:
            if stashed.loss.requires_grad:
                stashed.loss.backward()
        else:
            grads = list(out_grads or [])
            if len(grads) != len(stashed.outputs):
                raise RuntimeConfigError(
                    f"B s{s} b{b} got {len(grads)} output gradients for {len(stashed.outputs)} "
                    "output tensors; every rank must run the same model and partition."
                )
            pairs = [
                (out, grad)
                for out, grad in zip(stashed.outputs, grads, strict=True)
                if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [t.grad if t.requires_grad else None for t in stashed.inputs]

    @property
    def stashed(self) -> int:
        return len(self.stash)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
