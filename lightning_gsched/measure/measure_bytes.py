"""Measured bytes of each stage, for the planner's memory prediction (``schedule/memory.py``).

Why measure rather than compute from shapes: what a forward stashes for its backward depends on
every operator's choice of saved tensors (an attention kernel keeps its log-sum-exp, a GELU its
input, a view nothing), which no shape rule predicts. So the stages run once on one real
microbatch, chained as the pipeline chains them, and autograd's saved tensors are counted as
they are saved (:class:`lightning_gsched.runtime.footprint.SavedTensorBytes`, the same counter
the runtime uses while it trains, so prediction and measurement count the same tensors).

Stage inputs are built exactly as the runtime builds them (``runtime/wire.py``): detached leaves
of the producer's output when both stages run on one rank, fresh receive buffers (one per
tensor) when the input travels; a stage that saves a view of a local input keeps the producer's
storage alive, one that saves a received input keeps its own copy, so both cases are measured
(``activations`` and ``received_activations``) and the planner picks the one each forward meets.

Parameters follow the runtime's layout: a parameter read by one stage belongs to that stage's
buffer; those read by several (tied weights) form one tie per home stage (the lowest reading
stage), sized apart (:class:`~lightning_gsched.schedule.memory.TieSizes`, with its readers,
which are the ``ties`` the plan needs for these sizes: ``ModelSizes.tie_map``).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.errors import PartitionError
from lightning_gsched.measure.meta_attention import fused_attention_on_meta
from lightning_gsched.measure.profile import run_loss, run_stage
from lightning_gsched.partition.meta_run import has_meta_parameters
from lightning_gsched.partition.preserve import preserved_tensors_and_rng
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.footprint import SavedTensorBytes, held_until_w, weight_storages
from lightning_gsched.runtime.layout import split_parameters
from lightning_gsched.runtime.split_backward import backward_input
from lightning_gsched.schedule.memory import ModelSizes, StageSizes, TieSizes


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tensors)
               if isinstance(t, torch.Tensor))


def measure_stage_bytes(stages: Sequence[torch.nn.Module], args: tuple[Any, ...],
                        kwargs: dict[str, Any] | None = None,
                        loss_fn: Callable[[Any], torch.Tensor] | None = None,
                        optimizer_factor: float = 0.0) -> ModelSizes:
    """Each stage's parameter, gradient, optimizer, stashed-activation and message bytes.

    ``args``/``kwargs``: one microbatch, as one call of the model's forward. ``loss_fn``: maps
    the last stage's output to the loss (what the last stage's forward also stashes); without it
    the output's sum. ``optimizer_factor``: optimizer-state bytes per trainable parameter byte
    (``runtime.footprint.optimizer_factor(optimizer)``: 2 for Adam, 1 for SGD with momentum).
    Runs every stage's forward under autograd and discards the graphs: nothing is left behind
    (no ``.grad``; buffers such as BatchNorm statistics and the RNG streams are restored, so a
    run measured first draws the same dropout masks as one that was not).
    """
    if not stages:
        raise PartitionError("measure_stage_bytes needs at least one stage")
    own_params, ties = split_parameters(stages)
    sizes: list[StageSizes] = []
    # the previous stage's output: split into tensors, and its message's bytes
    handed: tuple[wire.Split, int] | None = None
    last = len(stages) - 1
    with torch.enable_grad(), ExitStack() as preserved:
        for stage in stages:
            preserved.enter_context(preserved_tensors_and_rng(stage))
        if any(has_meta_parameters(stage) for stage in stages):
            # sized on meta tensors: attention as the device's fused kernel saves it
            preserved.enter_context(fused_attention_on_meta())
        for s, stage in enumerate(stages):
            if handed is None:
                stash, loss_part, out = _stashed_bytes(stage, s, last, args, kwargs or {},
                                                       loss_fn)
                received = stash
                released, w_grads = _split_bytes(stage, s, last, args, kwargs or {}, [],
                                                 loss_fn)
            else:  # as the runtime feeds it: from this rank's producer, or from a message
                parts, _ = handed
                local = wire.join(parts.structure, wire.detached_leaves(parts.tensors))
                stash, loss_part, out = _stashed_bytes(stage, s, last, (local,), {}, loss_fn)
                leaves = wire.detached_leaves(parts.tensors)
                released, w_grads = _split_bytes(
                    stage, s, last, (wire.join(parts.structure, leaves),), {}, leaves, loss_fn)
                device = parts.tensors[0].device if parts.tensors else torch.device("cpu")
                message, _ = wire.received_copy(parts, device)
                received, _, _ = _stashed_bytes(stage, s, last, (message,), {}, loss_fn)
            own = own_params[s]
            trainable = _bytes([p for p in own if p.requires_grad])
            handed = None if s == last else _handed(out, s)
            # a checkpointed stage keeps its inputs (the model's input, or the message) and, on
            # the last stage, the loss's own graph
            inputs = (_bytes((args, kwargs)) if s == 0 else sizes[s - 1].message) + loss_part
            sizes.append(StageSizes(
                params=_bytes(own), grads=trainable,
                optimizer=int(trainable * optimizer_factor), activations=stash,
                # the buffers a receiver posts for it: its tensors' bytes
                message=0 if handed is None else handed[1],
                received_activations=received, inputs=inputs, loss_graph=loss_part,
                b_released=released, w_grads=w_grads))
    tie_sizes = {}
    for tie in ties:
        trainable = _bytes([p for p in tie.params if p.requires_grad])
        tie_sizes[tie.home] = TieSizes(tie.readers, _bytes(tie.params), trainable,
                                       int(trainable * optimizer_factor))
    return ModelSizes(tuple(sizes), tie_sizes)


def _stashed_bytes(stage: torch.nn.Module, s: int, last: int, args: tuple[Any, ...],
                   kwargs: dict[str, Any],
                   loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[int, int, Any]:
    """(bytes autograd saves in this stage's forward and loss, weights excluded; of those,
    the loss's own; the stage's output)."""
    weights = weight_storages(stage)
    with SavedTensorBytes(exclude=weights) as saved:
        out = run_stage(stage, s, last + 1, args, kwargs)
        loss_part = 0
        if s == last and loss_fn is not None:
            with SavedTensorBytes(exclude=weights) as in_loss:  # the innermost hooks apply
                run_loss(loss_fn, out)
            loss_part = in_loss.nbytes
            saved.storages.update(in_loss.storages)
    return saved.nbytes, loss_part, out


def _split_bytes(stage: torch.nn.Module, s: int, last: int, args: tuple[Any, ...],
                 kwargs: dict[str, Any],
                 leaves: list[torch.Tensor], loss_fn: Callable[[Any], torch.Tensor] | None,
                 ) -> tuple[int, int]:
    """(``b_released``, ``w_grads``): what a split B frees of this stage's stash, and the
    gradients it records for W; measured as the runtime meets them: a fresh forward on
    ``leaves`` (its inputs), B (:func:`backward_input`) from the loss or from fresh output
    gradients (as received), the roots dropped, then what is still held
    (:func:`~lightning_gsched.runtime.footprint.held_until_w`). W is not run: no ``.grad``."""
    weights = weight_storages(stage)
    with SavedTensorBytes(exclude=weights) as saved:
        out = run_stage(stage, s, last + 1, args, kwargs)
        if s == last and loss_fn is not None:
            roots = [run_loss(loss_fn, out).reshape(())]
            grads: list[torch.Tensor] | None = None
        else:
            roots = [t for t in wire.split(out, what=f"output of stage {s}").tensors
                     if t.requires_grad]
            grads = [torch.ones_like(t) for t in roots]
    del out
    params = [p for p in dict.fromkeys(stage.parameters()) if p.requires_grad]
    if not roots:
        return 0, 0
    _, pending = backward_input(roots, grads, leaves, params)
    del roots, grads  # as B's caller drops the stash: the graph above every weight goes
    held = held_until_w(saved, pending.held_tensors())
    kept = saved.alive_storages()
    del pending
    return saved.nbytes - sum(kept.values()), sum(held.values()) - sum(kept.values())


def _handed(output: Any, s: int) -> tuple[wire.Split, int]:
    """Stage ``s``'s output as the runtime hands it on: split, and its message's bytes."""
    parts = wire.split(output, what=f"output of stage {s}")
    return parts, wire.spec_of(parts).nbytes
