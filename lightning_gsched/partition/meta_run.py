"""Run a model built without weights (parameters on the meta device) for shapes alone.

Why: tracing, the example run that sizes what crosses each cut, and the memory prediction all
run the model once, and a deferred model (runtime/materialize.py) has no weights yet. On the
meta device every operation still yields its output's shape and dtype without computing
anything; but a kernel mixing a meta tensor with a real one (``masked_fill(meta, cpu_mask)``)
refuses. So while such a model runs for shapes, its buffers and the example are meta too
(:func:`buffers_on_meta`, :func:`to_meta`); the real buffers are put back afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def to_meta(tree: Any) -> Any:
    """The same pytree with every tensor replaced by a meta tensor of its shape and dtype."""
    return pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t, tree)


@contextlib.contextmanager
def buffers_on_meta(*modules: nn.Module) -> Iterator[None]:
    """Every buffer of ``modules`` (and of their submodules, stage containers included) is a
    meta copy inside; the original tensors are restored on exit."""
    saved: list[tuple[nn.Module, str, torch.Tensor]] = []
    for module in modules:
        for sub in module.modules():
            for name, buffer in list(sub._buffers.items()):
                if buffer is not None and not buffer.is_meta:
                    saved.append((sub, name, buffer))
                    sub._buffers[name] = buffer.to("meta")
    try:
        yield
    finally:
        for sub, name, buffer in saved:
            sub._buffers[name] = buffer
