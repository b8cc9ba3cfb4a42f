"""Measured bytes of one stage, for the planner's memory prediction (``schedule/memory.py``).

Why measure rather than compute from shapes: what a forward stashes for its backward depends on
every operator's choice of saved tensors (an attention kernel keeps its log-sum-exp, a GELU its
input, a view nothing), which no shape rule predicts. So each stage runs on one real
microbatch, chained as the pipeline chains them (the loop is the measuring pass,
:mod:`.stage_pass`), and autograd's saved tensors are counted as they are saved
(:class:`lightning_gsched.runtime.footprint.SavedTensorBytes`, the same counter the runtime
uses while it trains, so prediction and measurement count the same tensors).

:func:`size_stage` is a stage's byte repetition: one forward on the input as the producer hands
it over on the same rank (detached leaves of its output), counted, then B as the zero-bubble
runtime runs it (``runtime/split_backward.py``) on that same forward, to read what a split B
frees and what it keeps for W; and, for a stage fed by a message, one more forward on a fresh
receive buffer per tensor (``runtime/wire.py``). A stage that saves a view of a local input
keeps the producer's storage alive, one that saves a received input keeps its own copy, so
both cases are measured (``activations`` and ``received_activations``) and the planner picks
the one each forward meets.

Parameters follow the runtime's layout (:func:`model_sizes`): a parameter read by one stage
belongs to that stage's buffer; those read by several (tied weights) form one tie per home
stage (the lowest reading stage), sized apart (:class:`~lightning_gsched.schedule.memory.TieSizes`,
with its readers, which are the ``ties`` the plan needs for these sizes: ``ModelSizes.tie_map``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.measure.profile import run_loss, run_stage
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.footprint import SavedTensorBytes, held_until_w, weight_storages
from lightning_gsched.runtime.layout import split_parameters
from lightning_gsched.runtime.split_backward import backward_input
from lightning_gsched.schedule.memory import ModelSizes, StageSizes, TieSizes


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the tensors in a pytree (other leaves count nothing)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tensors)
               if isinstance(t, torch.Tensor))


@dataclass(frozen=True)
class StashBytes:
    """What one stage's byte repetition counted (see :class:`StageSizes` for each field);
    ``message``: its output's bytes as they travel, 0 for the last stage."""

    activations: int
    loss_graph: int
    received_activations: int
    b_released: int
    w_grads: int
    message: int


def size_stage(stage: torch.nn.Module, index: int, count: int, args: tuple[Any, ...],
               kwargs: dict[str, Any], leaves: list[torch.Tensor],
               message: tuple[Any, ...] | None,
               loss_fn: Callable[[Any], torch.Tensor] | None,
               ) -> tuple[StashBytes, wire.Split | None]:
    """One stage's bytes, and its output as the next stage receives it (None for the last).

    ``args``/``kwargs``: the stage's input as its producer hands it over on one rank, with
    ``leaves`` its tensors that require grad; ``message``: the same input as received from
    another rank (None for the first stage: its input is the model's). The returned output is
    a split pytree of fresh leaves (values and ``requires_grad`` of the output, no graph):
    holding it keeps no saved tensor of this stage alive, so B's release is read as the runtime
    meets it."""
    weights = weight_storages(stage)
    last = index == count - 1
    with SavedTensorBytes(exclude=weights) as saved:
        out = run_stage(stage, index, count, args, kwargs)
        loss_part, roots, grads = _roots(out, index, last, weights, saved, loss_fn)
    stash = saved.nbytes
    handed: wire.Split | None = None
    message_bytes = 0
    if not last:
        parts = wire.split(out, what=f"output of stage {index}")
        message_bytes = wire.spec_of(parts).nbytes
        handed = wire.Split(parts.structure, wire.detached_leaves(parts.tensors))
        del parts
    del out
    released, w_grads = _split_bytes(stage, saved, roots, grads, leaves)
    received = stash
    if message is not None:
        with SavedTensorBytes(exclude=weights) as again:
            out = run_stage(stage, index, count, message, {})
            _roots(out, index, last, weights, again, loss_fn)
        received = again.nbytes
        del out
    return StashBytes(stash, loss_part, received, released, w_grads, message_bytes), handed


def _roots(out: Any, index: int, last: bool, weights: list[int], saved: SavedTensorBytes,
           loss_fn: Callable[[Any], torch.Tensor] | None,
           ) -> tuple[int, list[torch.Tensor], list[torch.Tensor] | None]:
    """Within ``saved``'s hooks: the loss on the last stage, counted apart and absorbed (the
    innermost hooks apply), then B's roots; (the loss's own bytes, the roots, their
    gradients: None from the loss, ones from the outputs as received)."""
    if last and loss_fn is not None:
        with SavedTensorBytes(exclude=weights) as in_loss:
            loss = run_loss(loss_fn, out)
        saved.absorb(in_loss)
        return in_loss.nbytes, [loss.reshape(())], None
    roots = [t for t in wire.split(out, what=f"output of stage {index}").tensors
             if t.requires_grad]
    return 0, roots, [torch.ones_like(t) for t in roots]


def _split_bytes(stage: torch.nn.Module, saved: SavedTensorBytes, roots: list[torch.Tensor],
                 grads: list[torch.Tensor] | None, leaves: list[torch.Tensor]) -> tuple[int, int]:
    """(``b_released``, ``w_grads``): what a split B frees of the stash counted in ``saved``,
    and the gradients it records for W: B (:func:`backward_input`) from ``roots``, the roots
    dropped (emptied: the caller's list must not keep the graph alive), then what is still
    held (:func:`~lightning_gsched.runtime.footprint.held_until_w`). W is not run: no
    ``.grad``."""
    params = [p for p in dict.fromkeys(stage.parameters()) if p.requires_grad]
    if not roots:
        return 0, 0
    _, pending = backward_input(roots, grads, leaves, params)
    # as B's caller drops the stash: the graph above every weight goes
    roots.clear()
    if grads is not None:
        grads.clear()
    held = held_until_w(saved, pending.held_tensors())
    kept = saved.alive_storages()
    del pending
    return saved.nbytes - sum(kept.values()), sum(held.values()) - sum(kept.values())


def model_sizes(stages: Sequence[torch.nn.Module], stashes: Sequence[StashBytes],
                input_bytes: int, optimizer_factor: float) -> ModelSizes:
    """The stages' sizes from their byte repetitions, parameters in the runtime's layout.

    ``input_bytes``: the model's input (what a checkpointed first stage keeps);
    ``optimizer_factor``: optimizer-state bytes per trainable parameter byte."""
    own_params, ties = split_parameters(stages)
    sizes: list[StageSizes] = []
    for s, stash in enumerate(stashes):
        trainable = tensor_bytes([p for p in own_params[s] if p.requires_grad])
        # a checkpointed stage keeps its inputs (the model's input, or the message) and, on
        # the last stage, the loss's own graph
        inputs = (input_bytes if s == 0 else stashes[s - 1].message) + stash.loss_graph
        sizes.append(StageSizes(
            params=tensor_bytes(own_params[s]), grads=trainable,
            optimizer=int(trainable * optimizer_factor), activations=stash.activations,
            # the buffers a receiver posts for it: its tensors' bytes
            message=stash.message, received_activations=stash.received_activations,
            inputs=inputs, loss_graph=stash.loss_graph, b_released=stash.b_released,
            w_grads=stash.w_grads))
    tie_sizes = {}
    for tie in ties:
        trainable = tensor_bytes([p for p in tie.params if p.requires_grad])
        tie_sizes[tie.home] = TieSizes(tie.readers, tensor_bytes(tie.params), trainable,
                                       int(trainable * optimizer_factor))
    return ModelSizes(tuple(sizes), tie_sizes)
