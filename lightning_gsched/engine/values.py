"""Values crossing the engine's boundary: a model call made traceable, outputs moved.

Why a module of its own: Lightning runs evaluation under inference mode, whose tensors can be
neither traced nor saved for backward, and a forward-only step hands each rank's outputs back
across ranks on the host; these are pytree maps over whatever the user's step passes, kept
apart from the step logic that calls them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.engine.intercept import CallArgs


def normal_call(call: CallArgs) -> CallArgs:
    """A model call's ``(args, kwargs)`` with :func:`normal` values."""
    args, kwargs = call
    return tuple(normal(a) for a in args), {k: normal(v) for k, v in kwargs.items()}


def normal(value: Any) -> Any:
    """``value`` with each inference tensor cloned into a normal one (Lightning evaluates in
    inference mode, and an inference tensor can be neither traced nor saved for backward)."""

    def fix(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_inference():
            return leaf.clone()
        return leaf

    return pytree.tree_map(fix, value)


def to_cpu(value: Any) -> Any:
    """``value``'s tensors detached on the host, to travel in an object gather."""
    return pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


def to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors on ``device`` (outputs handed back to the rank that loaded them)."""
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)
