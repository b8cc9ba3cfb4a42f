"""Forward and backward of one stage on one microbatch, the stash between them, checkpointing.

Every stage boundary is cut: ``B s b`` may run long after ``F s b``, with the stage's weights
freed and refetched in between, so a backward covers one stage only. Stage inputs are fresh
leaves, ``B s b`` is ``autograd.backward(outputs of F s b, their gradients)`` and the inputs'
``.grad`` go to the producer. The last stage starts from ``loss_fn(output, b) / B``: the summed
gradients are those of the global batch's mean loss. A split backward stashes what the weight
gradients need (:mod:`.split_backward`) from ``B`` to ``W``. ``forward_context`` surrounds the
stage's forward call only, so a front end's precision applies as for ``model(x)`` on one device.

A checkpointed stage's ``F`` runs without a graph and keeps only its inputs and the generators'
state; ``B`` runs the forward again (charged to B by the planner) on the same inputs, generators
restored, inside the same ``forward_context``: bit-exact, and the ambient random stream is forked
around it. A stage that modifies an input in place (torch allows it without a graph) is refused.
On the last stage ``F`` still calls ``loss_fn``, on fresh leaves holding the output: the loss's
own small graph, which ``B`` backpropagates to those leaves first. Without a graph no output
requires grad, yet the next stage must know which inputs need one: :func:`flag_outputs` marks
every floating-point output the stage computed, when it has a trainable parameter or an input
requiring grad, as the reentrant ``torch.utils.checkpoint`` does; where the graph would not have
(a float computed from a buffer alone), the replay drops the extra gradient: extra work only.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.footprint import SavedTensorBytes, held_until_w, weight_storages
from lightning_gsched.runtime.split_backward import PendingWeightGrad, backward_input
from lightning_gsched.runtime.stage_streams import StageStreams

LossFn = Callable[[Any, int], torch.Tensor]
ForwardContext = Callable[[], AbstractContextManager[Any]]
# one microbatch's call of a stage (or of the model): positional and keyword arguments
CallArgs = tuple[tuple[Any, ...], dict[str, Any]]


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Indices of the CUDA devices the tensors live on (sorted, once each)."""
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


@dataclass
class Replay:
    """What ``B s b`` needs to run a checkpointed ``F s b`` again: its inputs and the state of
    the CPU generator and of the CUDA ones of the stage's and inputs' devices (the default
    generators only, as ``torch.utils.checkpoint`` preserves them)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    cpu_rng: torch.Tensor
    cuda_rng: list[tuple[int, torch.Tensor]]
    versions: list[tuple[torch.Tensor, int]]  # every distinct input tensor and its version at F
    out_leaves: list[torch.Tensor] = field(default_factory=list)  # last stage: what loss_fn saw

    @classmethod
    def take(cls, args: tuple[Any, ...], kwargs: dict[str, Any], stage_devices: Sequence[int]
             ) -> "Replay":
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = list({id(t): t for t in leaves if isinstance(t, torch.Tensor)}.values())
        devices = sorted({*stage_devices, *cuda_devices(tensors)})
        return cls(args, kwargs, torch.get_rng_state(),
                   [(d, torch.cuda.get_rng_state(d)) for d in devices],
                   [(t, t._version) for t in tensors])

    @contextmanager
    def rng_restored(self) -> Iterator[None]:
        """Inside: the generators as they were at F; afterwards: as before entering."""
        with torch.random.fork_rng(devices=[d for d, _ in self.cuda_rng], device_type="cuda"):
            torch.set_rng_state(self.cpu_rng)
            for device, state in self.cuda_rng:
                torch.cuda.set_rng_state(state, device)
            yield

    def check_inputs(self, s: int, b: int) -> None:
        """Refuse a replay from inputs modified in place since F took them."""
        for i, (tensor, version) in enumerate(self.versions):
            if tensor._version != version:
                raise RuntimeConfigError(
                    f"input tensor {i} (shape {tuple(tensor.shape)}) of stage {s} was modified "
                    f"in place after F s{s} b{b} took it, so B s{s} b{b} cannot recompute the "
                    "stage's forward from it (activation checkpointing). Make the stage leave "
                    "its inputs unchanged (e.g. x = x + y instead of x += y, or a ReLU without "
                    "inplace=True), or turn checkpoint_activations off for this stage.")


def flag_outputs(tensors: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                 differentiable: bool) -> list[torch.Tensor]:
    """The outputs of a forward run without a graph, flagged for the next stage: when
    ``differentiable``, a computed floating-point (or complex) output becomes a detached alias
    requiring grad (an alias, so a buffer or user tensor returned as output is never changed)."""
    given = {id(t) for t in inputs}
    return [t.detach().requires_grad_() if differentiable and not t.requires_grad
            and id(t) not in given and (t.is_floating_point() or t.is_complex()) else t
            for t in tensors]


def loss_gradients(loss: torch.Tensor, leaves: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor], split: bool,
                   ) -> tuple[list[torch.Tensor | None], PendingWeightGrad | None]:
    """Backpropagate the last stage's loss to the leaves ``loss_fn`` saw (its own small graph).

    Ordinary backward: ``loss.backward()``, so a parameter the loss code reads accumulates as
    without checkpointing. Split backward: the loss graph's own B, whose weight part runs first
    in the stage's W. A parameter reached both through the loss code and the stage then
    accumulates its two terms one after the other instead of their sum: float rounding.
    """
    if not split:
        if loss.requires_grad:
            loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward: unannotated
        return [t.grad if t.requires_grad else None for t in leaves], None
    return backward_input([loss], None, leaves, params)


@dataclass
class Stashed:
    """What ``B s b`` needs from ``F s b``."""

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
        self.streams = StageStreams(self.devices)  # each stage's dropout masks its own
        self.last = len(self.stages) - 1
        self.num_micro = num_micro
        self.stash: dict[tuple[int, int], Stashed] = {}
        # trainable parameters no stage reads that the loss code may (a loss module's):
        # loss.backward() accumulates them, so a split backward's W must too
        self.loss_params: list[torch.Tensor] = []
        # split backward: (stage, micro) -> the weight-gradient work its B left for its W, in
        # order (a checkpointed last stage's: the loss graph's, then the recomputed stage's)
        self.pending_weights: dict[tuple[int, int], list[PendingWeightGrad]] = {}
        self.params: list[list[torch.Tensor]] = [
            [p for p in dict.fromkeys(stage.parameters()) if p.requires_grad]
            for stage in self.stages]
        # when a dict: seconds of every F / B / W by (phase, stage) (ProgramExecutor.compute_times)
        self.times: dict[tuple[str, int], list[float]] | None = None
        # when a dict: the storages (address -> bytes) autograd saved in each stashed F (stage,
        # micro), dropped with the stash (runtime/footprint.py)
        self.saved_bytes: dict[tuple[int, int], dict[int, int]] | None = None
        # the counters behind saved_bytes, until the B of their (stage, micro) (narrow_stash)
        self.saved_counters: dict[tuple[int, int], SavedTensorBytes] = {}

    @contextmanager
    def _timed(self, phase: str, s: int) -> Iterator[None]:
        if self.times is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times.setdefault((phase, s), []).append(time.perf_counter() - start)

    def forward(self, s: int, b: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                in_leaves: list[torch.Tensor], loss_fn: LossFn,
                ) -> tuple[wire.Split | None, torch.Tensor | None]:
        """Run ``F s b``; returns (output split for the next stage, unscaled loss on the last).
        It draws from stage ``s``'s own random stream (:mod:`.stage_streams`)."""
        with self._timed("F", s), self.streams.drawing(s):
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

    def _forward_checkpointed(self, s: int, b: int, args: tuple[Any, ...], kwargs: dict[str, Any],
                              in_leaves: list[torch.Tensor], loss_fn: LossFn,
                              ) -> tuple[wire.Split | None, torch.Tensor | None]:
        """``F s b`` of a checkpointed stage: no graph; it keeps the inputs and generators, and on
        the last stage the loss's own graph."""
        replay = Replay.take(args, kwargs, self.devices[s])
        with self._saved(s, b, held=[t for t, _ in replay.versions]):
            with torch.no_grad(), self.forward_context():
                output = self.stages[s](*args, **kwargs)
            parts = wire.split(output, what=f"output of stage {s}")
            differentiable = bool(self.params[s]) or any(t.requires_grad for t in in_leaves)
            tensors = flag_outputs(parts.tensors, [t for t, _ in replay.versions], differentiable)
            if s != self.last:
                self.stash[(s, b)] = Stashed(in_leaves, replay=replay)
                return wire.Split(parts.structure, tensors), None
            replay.out_leaves = wire.detached_leaves(tensors)
            with torch.enable_grad():  # the loss's own small graph, from the leaves
                loss = self._loss(loss_fn, wire.join(parts.structure, replay.out_leaves), b)
                scaled = loss.reshape(()) / self.num_micro
            self.stash[(s, b)] = Stashed(in_leaves, loss=scaled, replay=replay)
            return None, loss.detach()

    @contextmanager
    def _saved(self, s: int, b: int, held: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        """When recording, count what autograd saves in ``F s b`` (weights and buffers excluded)
        plus ``held``, kept besides. A checkpointed stage's recompute records again: from then
        to W the stash holds the recomputed graph."""
        if self.saved_bytes is None:
            yield
            return
        with SavedTensorBytes(exclude=weight_storages(self.stages[s])) as counter:
            yield
        for t in held:
            counter.count(t)
        self.saved_bytes[(s, b)] = counter.storages
        self.saved_counters[(s, b)] = counter

    def narrow_stash(self, s: int, b: int) -> None:
        """After a split ``B s b`` (``OpRules.narrows_stash``): until ``W s b`` the record of (s, b)
        is what it really holds, :func:`~.footprint.held_until_w` (B dropped the graph's roots,
        e.g. the loss's nodes)."""
        counter = self.saved_counters.pop((s, b), None)
        if self.saved_bytes is None or counter is None:
            return
        held = [t for part in self.pending_weights[(s, b)] for t in part.held_tensors()]
        self.saved_bytes[(s, b)] = held_until_w(counter, held)

    def live_activation_bytes(self) -> int:
        """Bytes saved by the forwards whose stash is still held (see :attr:`saved_bytes`)."""
        if self.saved_bytes is None:
            return 0
        held = set(self.stash) | set(self.pending_weights)
        return sum(sum(storages.values()) for key, storages in self.saved_bytes.items()
                   if key in held)

    @staticmethod
    def _loss(loss_fn: LossFn, output: Any, b: int) -> torch.Tensor:
        loss = loss_fn(output, b)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                   else type(loss).__name__)
            raise RuntimeConfigError(
                f"loss_fn(output, {b}) must return a scalar tensor, got {got}; "
                "reduce the loss (e.g. .mean()) inside loss_fn.")
        return loss

    def infer(self, s: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Forward of stage ``s`` without autograd and without stashing (forward-only runs),
        drawing from the stage's own stream as :meth:`forward` (dropout kept on in a
        prediction, Monte Carlo dropout, draws a mask of its own per stage)."""
        with torch.no_grad(), self.streams.drawing(s), self.forward_context():
            return self.stages[s](*args, **kwargs)

    def backward(self, s: int, b: int, out_grads: Sequence[Any] | None,
                 split: bool = False) -> list[Any]:
        """Run ``B s b``; returns the gradients of the stage's input tensors (None where none).
        ``split``: input gradients only; the weight gradients wait for :meth:`weight`."""
        with self._timed("B", s):
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
                    [pending] if loss_weights is None else [loss_weights, pending])
                return list(input_grads)  # the record ends at narrow_stash
            if roots:
                torch.autograd.backward(roots, grads)
            input_grads = [t.grad if t.requires_grad else None for t in stashed.inputs]
        self.saved_counters.pop((s, b), None)  # the record ends here
        return input_grads

    def weight(self, s: int, b: int) -> None:
        """Run ``W s b``: accumulate the weight gradients that ``B s b`` (split) left."""
        pending = self.pending_weights.pop((s, b), None)
        if pending is None:
            raise RuntimeConfigError(
                f"W s{s} b{b} without a split B s{s} b{b} before it on this rank; the programs "
                "are not from this planner.")
        with self._timed("W", s):
            for part in pending:
                part.run()

    def _weight_params(self, s: int) -> list[torch.Tensor]:
        """The parameters a split backward of stage ``s`` accumulates: the stage's, and on the last
        stage also :attr:`loss_params` (what ``loss.backward()`` would reach)."""
        if s != self.last or not self.loss_params:
            return self.params[s]
        return list(dict.fromkeys([*self.params[s], *self.loss_params]))

    def _roots(self, s: int, b: int, stashed: Stashed, out_grads: Sequence[Any] | None,
               split: bool) -> tuple[list[torch.Tensor], list[Any] | None]:
        """Where ``B s b`` starts: tensors and their gradients (None: the loss, a gradient of ones).
        A checkpointed stage's forward runs again here."""
        replay, loss = stashed.replay, stashed.loss
        if replay is not None:  # out_grads: on the last stage, the leaves' (see backward)
            replay.check_inputs(s, b)
            with replay.rng_restored(), torch.enable_grad(), self._saved(s, b), \
                    self.forward_context():
                output = self.stages[s](*replay.args, **replay.kwargs)
            outputs = wire.split(output, what=f"output of stage {s}").tensors
        elif loss is None:
            outputs = stashed.outputs
        else:
            return ([loss] if split or loss.requires_grad else []), None
        grads = list(out_grads or [])
        if len(grads) != len(outputs):
            raise RuntimeConfigError(
                f"B s{s} b{b} got {len(grads)} output gradients for {len(outputs)} "
                "output tensors; every rank must run the same model and partition.")
        # outputs without a gradient, or that need none, are left out
        pairs = [(out, grad) for out, grad in zip(outputs, grads, strict=True)
                 if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

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
            "flags, plan(..., checkpoint_activations=...).checkpointed.")
    return flags
