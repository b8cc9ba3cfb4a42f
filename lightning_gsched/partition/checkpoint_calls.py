"""Notice ``torch.utils.checkpoint`` calls (non-reentrant) that a trace goes through, and find
the reentrant ones a split keeps.

Why: fx records the operations a checkpointed function computes, not the checkpoint around
them, so the split keeps every activation the user meant to recompute, silently, and a
BatchNorm inside is updated once per step where one device's recompute updates it twice. The
reentrant form (``use_reentrant=True``) is an autograd Function, which the trace records as one
node (:mod:`.recording`): it runs as written in its stage. The non-reentrant one (torch's
default) is noticed here, while tracing, and the partitioner warns naming the module and the
ways to keep the recompute. The reentrant form cannot run under a split backward (B then W,
each a ``torch.autograd.grad`` call: torch refuses ``.grad()`` through it), which used to fail
inside the first step's first B on some ranks: :func:`reentrant_checkpoints` finds it in the
stages so the build can refuse it first, naming the module (:func:`split_backward_refusal`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Sequence

from torch import nn


class CheckpointTracedWarning(UserWarning):
    """A forward calls ``torch.utils.checkpoint`` (non-reentrant), which the split traces
    through: its recompute (and the memory it saves) is lost."""


@contextlib.contextmanager
def checkpoint_calls_noted(where: Callable[[], str]) -> Iterator[list[str]]:
    """Inside, every non-reentrant ``torch.utils.checkpoint.checkpoint`` call appends
    ``where()`` (the module being traced) to the list yielded; the call itself runs as usual."""
    import torch.utils.checkpoint as checkpoint

    seen: list[str] = []
    original = checkpoint._checkpoint_without_reentrant_generator

    def noted(*args: Any, **kwargs: Any) -> Any:
        seen.append(where())
        return original(*args, **kwargs)

    checkpoint._checkpoint_without_reentrant_generator = noted
    try:
        yield seen
    finally:
        checkpoint._checkpoint_without_reentrant_generator = original


def warn_checkpoint_traced(seen: list[str], model: str) -> None:
    """The warning for :func:`checkpoint_calls_noted`'s findings (none: nothing)."""
    if not seen:
        return
    places = ", ".join(dict.fromkeys(seen))
    warnings.warn(CheckpointTracedWarning(
        f"{model}'s forward calls torch.utils.checkpoint (non-reentrant) in {places}: the split "
        "records what the checkpointed code computes, not the checkpoint, so its activations "
        "are kept instead of recomputed (and a BatchNorm inside is updated once per step, not "
        "twice as on one device). For the pipeline's own recompute, checkpoint_activations="
        "True (or per stage) on the strategy; to run the call as written, keep its module "
        "whole, leaf_modules=(...,); or use_reentrant=True, which the split keeps as one call "
        "(not under a schedule that splits the backward: zb-h1, zb-h2, zbv, v-half, v-min)"),
        stacklevel=3)


def reentrant_checkpoints(stages: Sequence[nn.Module]) -> list[str]:
    """``"stage 1 (module 'blocks.3')"`` for each call of ``torch.utils.checkpoint`` with
    ``use_reentrant=True`` in the stages (the split keeps it as one autograd Function call)."""
    from torch.utils.checkpoint import CheckpointFunction

    from lightning_gsched.partition.recording import FunctionApply
    from lightning_gsched.partition.tracer import SCOPE

    found = []
    for k, stage in enumerate(stages):
        graph = getattr(stage, "traced_graph", None)
        for node in graph.nodes if graph is not None else ():
            if isinstance(node.target, FunctionApply) and node.target.function is CheckpointFunction:
                scope = node.meta.get(SCOPE) or ()
                where = f"module {scope[-1][0]!r}" if scope else "the forward itself"
                found.append(f"stage {k} ({where})")
    return list(dict.fromkeys(found))


def split_backward_refusal(schedule: str, found: Sequence[str]) -> str:
    """Why a schedule whose backward is split cannot run reentrant checkpoints, and the fixes."""
    shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    return (f"schedule {schedule!r} splits each backward into B (input gradients) and W (weight "
            "gradients), each a torch.autograd.grad call, and the model calls "
            f"torch.utils.checkpoint with use_reentrant=True in {shown}: torch refuses .grad() "
            "through a reentrant checkpoint. Use use_reentrant=False (the split then keeps the "
            "activations; checkpoint_activations=True on the strategy recomputes whole stages "
            "instead), a schedule without the split (gpipe, 1f1b, interleaved, lpp, fsdp, "
            "fslpp, ddp), or split_backward=False")
