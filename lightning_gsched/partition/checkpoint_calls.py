"""Notice ``torch.utils.checkpoint`` calls (non-reentrant) that a trace goes through.

Why: fx records the operations a checkpointed function computes, not the checkpoint around
them, so the split keeps every activation the user meant to recompute, silently, and a
BatchNorm inside is updated once per step where one device's recompute updates it twice. The
reentrant form (``use_reentrant=True``) is an autograd Function, which the trace records as one
node (:mod:`.recording`): it runs as written in its stage. The non-reentrant one (torch's
default) is noticed here, while tracing, and the partitioner warns naming the module and the
ways to keep the recompute.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator


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
        "whole, leaf_modules=(...,); or use_reentrant=True, which the split keeps as one call"),
        stacklevel=3)
