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

Split backward (zero-bubble programs): ``backward(..., split=True)`` computes only the input
gradients and keeps what the weight gradients need (:mod:`.split_backward`); :meth:`weight`
(the program's ``W s b``) accumulates them later. The (stage, microbatch) counts as stashed until
then, as the planner counts it.

``forward_context`` (optional) is entered around every stage's forward call, and only there: a
front end's precision (autocast, a default dtype) then applies to the model's computation as it
does for ``model(x)`` on one device, not to the loss code after the model or to the backward.

Activation checkpointing (``checkpointed[s]``, see :mod:`.recompute`): ``F s b`` runs the stage
under ``torch.no_grad`` and stashes its inputs and the random generators' state instead of a
graph; ``B s b`` runs the forward again with the generators restored (forked), then does what
B does for any stage. On the last stage, ``F`` still calls ``loss_fn`` once: on fresh leaves
holding the stage's output, so the loss has a small graph of its own; ``B`` backpropagates the
loss to those leaves first, then recomputes the stage and continues from their gradients.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, ParamSpec, Sequence, TypeVar

import torch
from torch import nn

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.footprint import SavedTensorBytes, held_until_w, weight_storages
from lightning_gsched.runtime.recompute import (
    ChainedWeightGrad,
    Replay,
    cuda_devices,
    flag_outputs,
    fresh_leaves,
    loss_gradients,
)
from lightning_gsched.runtime.split_backward import PendingWeightGrad, backward_input

LossFn = Callable[[Any, int], torch.Tensor]
ForwardContext = Callable[[], AbstractContextManager[Any]]
_P = ParamSpec("_P")
_T = TypeVar("_T")
# one microbatch's call of a stage (or of the model): positional and keyword arguments
CallArgs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class Stashed:
    """What ``B s b`` needs from ``F s b``: the graph's roots and the input leaves (or, for a
    checkpointed stage, how to run its forward again)."""

    inputs: list[torch.Tensor]  # stage inputs (fresh leaves); their .grad is the input-gradient
    outputs: list[torch.Tensor] = field(default_factory=list)  # non-last stage: output tensors
    loss: torch.Tensor | None = None  # last stage: loss / B
    replay: Replay | None = None  # checkpointed stage: no outputs kept, the forward runs again


class StageCompute:
    """Runs stages and keeps the stash; knows nothing about ranks or messages."""

    def __init__(self, stages: Sequence[nn.Module], num_micro: int,
                 forward_context: ForwardContext | None = None,
                 checkpointed: Sequence[bool] | None = None) -> None:
        self.stages = list(stages)
        self.checkpointed = check_checkpointed(checkpointed, len(self.stages))
        # CUDA devices whose generators a checkpointed stage's replay restores (inputs add theirs)
        self.devices = [cuda_devices([*stage.parameters(), *stage.buffers()])
                        for stage in self.stages]
        self.forward_context: ForwardContext = forward_context or nullcontext
        self.last = len(self.stages) - 1
        self.num_micro = num_micro
        self.stash: dict[tuple[int, int], Stashed] = {}
        # trainable parameters no stage reads that the last stage's loss code may (a loss
        # module's): loss.backward() accumulates them, so a split backward's W must too
        self.loss_params: list[torch.Tensor] = []
        # split backward: (stage, micro) -> the weight-gradient work its B left for its W
        self.pending_weights: dict[tuple[int, int], PendingWeightGrad | ChainedWeightGrad] = {}
        self.params: list[list[torch.Tensor]] = [
            [p for p in dict.fromkeys(stage.parameters()) if p.requires_grad]
            for stage in self.stages]
        # when a dict: seconds of every forward / backward, keyed ("F" | "B", stage); the
        # in-run profile that predict_step_time can replay (ProgramExecutor.compute_times)
        self.times: dict[tuple[str, int], list[float]] | None = None
        # when a dict: the storages (address -> bytes) autograd saved in each stashed F
        # (stage, micro), dropped with the stash; the runtime's side of the planner's
        # activation bytes (runtime/footprint.py)
        self.saved_bytes: dict[tuple[int, int], dict[int, int]] | None = None
        # the counters behind saved_bytes, until the B of their (stage, micro): a split B
        # narrows the record from them (narrow_stash)
        self.saved_counters: dict[tuple[int, int], SavedTensorBytes] = {}

    def forward(
        self,
        s: int,
        b: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_leaves: list[torch.Tensor],
        loss_fn: LossFn,
    ) -> tuple[wire.Split | None, torch.Tensor | None]:
        """Run ``F s b``; returns (output split for the next stage, unscaled loss on the last)."""
        return self._timed("F", s, self._forward, s, b, args, kwargs, in_leaves, loss_fn)

    def _forward(self, s: int, b: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                 in_leaves: list[torch.Tensor], loss_fn: LossFn
                 ) -> tuple[wire.Split | None, torch.Tensor | None]:
        if self.checkpointed[s]:
            return self._forward_checkpointed(s, b, args, kwargs, in_leaves, loss_fn)
        with torch.enable_grad(), self._saved(s, b):
            with self.forward_context():
                output = self.stages[s](*args, **kwargs)
            if s == self.last:
                loss = self._loss(loss_fn, output, b)
                self.stash[(s, b)] = Stashed(in_leaves, loss=loss.reshape(()) / self.num_micro)
                return None, loss.detach()
        parts = wire.split(output, what=f"output of stage {s}")
        self.stash[(s, b)] = Stashed(in_leaves, outputs=parts.tensors)
        return parts, None

    @contextmanager
    def _saved(self, s: int, b: int, held: Sequence[Any] = ()) -> Iterator[None]:
        """Count what autograd saves in ``F s b`` (weights and buffers excluded), plus the
        tensors in ``held`` that the stash keeps besides (a checkpointed stage's inputs), when
        asked. A checkpointed stage's recompute at a split B records again, replacing F's
        record: from then to W the stash holds the recomputed graph (the loss's own graph, on a
        last stage, was released by that B's ``autograd.grad``)."""
        if self.saved_bytes is None:
            yield
            return
        with SavedTensorBytes(exclude=weight_storages(self.stages[s])) as counter:
            yield
        for t in held:
            if isinstance(t, torch.Tensor):
                counter.count(t)
        self.saved_bytes[(s, b)] = counter.storages
        self.saved_counters[(s, b)] = counter

    def narrow_stash(self, s: int, b: int) -> None:
        """After a split ``B s b`` (``OpRules.narrows_stash``): from now to ``W s b`` the record
        of (s, b) is what it really holds, :func:`~.footprint.held_until_w`: the saved tensors
        autograd still keeps (B dropped the graph's roots: the nodes above every weight, e.g.
        the loss's, are gone) and the gradients B recorded for W."""
        counter = self.saved_counters.pop((s, b), None)
        if self.saved_bytes is None or counter is None:
            return
        self.saved_bytes[(s, b)] = held_until_w(counter,
                                                self.pending_weights[(s, b)].held_tensors())

    def live_activation_bytes(self) -> int:
        """Bytes saved by the forwards whose stash is still held (see :attr:`saved_bytes`)."""
        if self.saved_bytes is None:
            return 0
        held = set(self.stash) | set(self.pending_weights)
        return sum(sum(storages.values()) for key, storages in self.saved_bytes.items()
                   if key in held)

    def _forward_checkpointed(
        self, s: int, b: int, args: tuple[Any, ...], kwargs: dict[str, Any],
        in_leaves: list[torch.Tensor], loss_fn: LossFn,
    ) -> tuple[wire.Split | None, torch.Tensor | None]:
        """``F s b`` of a checkpointed stage: no graph; the inputs and generators are kept."""
        replay = Replay.take(args, kwargs, self.devices[s])
        # what it keeps: the inputs, and on the last stage the loss's own graph
        with self._saved(s, b, held=[t for t, _ in replay.versions]):
            return self._run_checkpointed(s, b, args, kwargs, in_leaves, loss_fn, replay)

    def _run_checkpointed(
        self, s: int, b: int, args: tuple[Any, ...], kwargs: dict[str, Any],
        in_leaves: list[torch.Tensor], loss_fn: LossFn, replay: Replay,
    ) -> tuple[wire.Split | None, torch.Tensor | None]:
        with torch.no_grad(), self.forward_context():
            output = self.stages[s](*args, **kwargs)
        parts = wire.split(output, what=f"output of stage {s}")
        differentiable = bool(self.params[s]) or any(t.requires_grad for t in in_leaves)
        tensors = flag_outputs(parts.tensors, [t for t, _ in replay.versions], differentiable)
        if s != self.last:
            self.stash[(s, b)] = Stashed(in_leaves, replay=replay)
            return wire.Split(parts.structure, tensors), None
        replay.out_leaves = fresh_leaves(tensors)
        with torch.enable_grad():  # the loss's own small graph, from the leaves
            loss = self._loss(loss_fn, wire.join(parts.structure, replay.out_leaves), b)
            scaled = loss.reshape(()) / self.num_micro
        self.stash[(s, b)] = Stashed(in_leaves, loss=scaled, replay=replay)
        return None, loss.detach()

    @staticmethod
    def _loss(loss_fn: LossFn, output: Any, b: int) -> torch.Tensor:
        loss = loss_fn(output, b)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise RuntimeConfigError(
                f"loss_fn(output, {b}) must return a scalar tensor, got {_describe(loss)}; "
                "reduce the loss (e.g. .mean()) inside loss_fn."
            )
        return loss

    def infer(self, s: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Forward of stage ``s`` without autograd and without stashing (forward-only runs)."""
        with torch.no_grad(), self.forward_context():
            return self.stages[s](*args, **kwargs)

    def backward(self, s: int, b: int, out_grads: Sequence[Any] | None,
                 split: bool = False) -> list[Any]:
        """Run ``B s b``; returns the gradients of the stage's input tensors (None where none).

        ``split``: input gradients only; the weight gradients wait for :meth:`weight`.
        """
        grads = self._timed("B", s, self._backward, s, b, out_grads, split)
        if not split:  # the record ends here (a split B's: at narrow_stash)
            self.saved_counters.pop((s, b), None)
        return grads

    def weight(self, s: int, b: int) -> None:
        """Run ``W s b``: accumulate the weight gradients that ``B s b`` (split) left."""
        pending = self.pending_weights.pop((s, b), None)
        if pending is None:
            raise RuntimeConfigError(
                f"W s{s} b{b} without a split B s{s} b{b} before it on this rank; the programs "
                "are not from this planner."
            )
        self._timed("W", s, pending.run)

    def _timed(self, phase: str, s: int, fn: Callable[_P, _T], *args: _P.args,
               **kwargs: _P.kwargs) -> _T:
        """``fn(*args)``, its seconds recorded under (phase, stage) while timing is on."""
        if self.times is None:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.times.setdefault((phase, s), []).append(time.perf_counter() - start)

    def _backward(self, s: int, b: int, out_grads: Sequence[Any] | None,
                  split: bool) -> list[Any]:
        stashed = self.stash.pop((s, b))
        loss_weights = None
        if stashed.replay is not None and stashed.loss is not None:
            # checkpointed last stage: first the loss's own graph, down to the leaves
            out_grads, loss_weights = loss_gradients(stashed.loss, stashed.replay.out_leaves,
                                                     self._weight_params(s), split)
        roots, grads = self._roots(s, b, stashed, out_grads, split)
        if split:
            input_grads, pending = backward_input(roots, grads, stashed.inputs,
                                                  self._weight_params(s))
            self.pending_weights[(s, b)] = (
                pending if loss_weights is None else ChainedWeightGrad(loss_weights, pending))
            return list(input_grads)
        if roots:
            torch.autograd.backward(roots, grads)
        return [t.grad if t.requires_grad else None for t in stashed.inputs]

    def _weight_params(self, s: int) -> list[torch.Tensor]:
        """The parameters a split backward of stage ``s`` accumulates: the stage's, and on the
        last stage also :attr:`loss_params` (what ``loss.backward()`` would reach)."""
        if s != self.last or not self.loss_params:
            return self.params[s]
        return list(dict.fromkeys([*self.params[s], *self.loss_params]))

    def _roots(self, s: int, b: int, stashed: Stashed, out_grads: Sequence[Any] | None,
               split: bool) -> tuple[list[torch.Tensor], list[Any] | None]:
        """Where the backward of ``B s b`` starts: tensors and their gradients (None: the loss,
        a gradient of ones). A checkpointed stage's forward runs again here."""
        replay, loss = stashed.replay, stashed.loss
        if replay is not None:  # out_grads: on the last stage, the leaves' (see _backward)
            return _output_pairs(s, b, self._recompute(s, b, replay), out_grads)
        if loss is None:
            return _output_pairs(s, b, stashed.outputs, out_grads)
        return ([loss] if split or loss.requires_grad else []), None

    def _recompute(self, s: int, b: int, replay: Replay) -> list[torch.Tensor]:
        """The output tensors of ``F s b`` again, with their graph (see :mod:`.recompute`)."""
        replay.check_inputs(s, b)
        with replay.rng.restored(), torch.enable_grad(), self._saved(s, b), \
                self.forward_context():
            output = self.stages[s](*replay.args, **replay.kwargs)
        return wire.split(output, what=f"output of stage {s}").tensors

    @property
    def stashed(self) -> int:
        """(stage, microbatch) pairs whose activations are held: until B, or W when split."""
        return len(self.stash) + len(self.pending_weights)


def check_checkpointed(checkpointed: Sequence[bool] | None, stages: int) -> list[bool]:
    """One bool per stage (None: no stage checkpointed), e.g. ``plan(...).checkpointed``."""
    if checkpointed is None:
        return [False] * stages
    flags = list(checkpointed)
    if len(flags) != stages or not all(isinstance(f, bool) for f in flags):
        raise RuntimeConfigError(
            f"checkpointed={flags!r} must be one bool per stage ({stages}); pass the plan's "
            "flags, plan(..., checkpoint_activations=...).checkpointed."
        )
    return flags


def _output_pairs(s: int, b: int, outputs: Sequence[Any], out_grads: Sequence[Any] | None
                  ) -> tuple[list[torch.Tensor], list[Any]]:
    """The stage outputs a backward starts from, with their incoming gradients (outputs without
    a gradient, or that need none, left out)."""
    grads = list(out_grads or [])
    if len(grads) != len(outputs):
        raise RuntimeConfigError(
            f"B s{s} b{b} got {len(grads)} output gradients for {len(outputs)} "
            "output tensors; every rank must run the same model and partition."
        )
    pairs = [
        (out, grad)
        for out, grad in zip(outputs, grads, strict=True)
        if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad
    ]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
