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
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from lightning_gsched.partition.errors import DeferredTraceError


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


_FIX = ("Build the model with its weights where one rank can hold it while the split is made "
        "(outside init_module(empty_init=True) and configure_model's meta device): it is then "
        "traced on real values. Or keep the module that does this whole, leaf_modules=(...,), "
        "if it is not most of the model: a leaf runs its own code at every call")


def refuse_valueless_trace(owner: str, graph_nodes: Iterable[fx.Node],
                           constants: Mapping[str, Any]) -> None:
    """Refuse the trace of a model without weights that kept what meta tensors cannot give.

    Why: where fx cannot trace symbolically, the static-shape mode runs the forward on the
    example and keeps every tensor the forward builds outside the graph (an attention mask's
    indices, ``torch.arange`` positions) as a constant of the split, and every device it reads
    as a literal. Traced on meta (a deferred model), those constants have no values and the
    literal is the meta device: the first real forward would fail on the stage ("Tensor on
    device meta is not on the expected device"), on every rank, long after the build. Refused
    here, naming where the first one was made."""
    found: list[tuple[str, fx.Node]] = []
    for node in graph_nodes:
        if node.op == "get_attr" and isinstance(constants.get(str(node.target)), torch.Tensor) \
                and constants[str(node.target)].is_meta:
            found.append(("builds a tensor (kept as a constant of the split)", node))
        elif _reads_meta_device((node.args, node.kwargs)):
            found.append(("moves a tensor to the device it read (kept as a literal)", node))
    if not found:
        return
    what, node = found[0]
    scope = node.meta.get("gsched_scope") or ()
    where = f"in module {scope[-1][0]!r}" if scope else f"in {owner}.forward itself"
    raise DeferredTraceError(
        f"{owner} is built without weights (its parameters are on the meta device), so it was "
        f"traced on meta tensors, which have shapes but no values; its forward {what} {where} "
        f"({len(found)} such place(s)), e.g. an attention mask or positions made with "
        "torch.arange(..., device=x.device) while the model is traced with static shapes. On "
        "the meta device that tensor has no values and that device is not the one the stages "
        f"run on, so the split would fail at its first step. {_FIX}")


def refuse_value_read(owner: str, error: Exception) -> None:
    """Re-raise an example run's failure on meta tensors as what it is: the model's code reads
    a value (``.item()``, a mask's packed-sequence check), and a model built without weights is
    run on meta tensors for its shapes only. Other failures are left to the caller."""
    if isinstance(error, DeferredTraceError):
        return
    cause = error.__cause__ if isinstance(error.__cause__, Exception) else error
    if "meta" not in str(cause):
        return
    where = getattr(error, "where", "")
    raise DeferredTraceError(
        f"{owner} is built without weights (its parameters are on the meta device), so the "
        "partitioner runs it on meta tensors, which have shapes but no values, and its forward "
        f"reads a value{' at ' + where if where else ''}: {type(cause).__name__}: {cause}. "
        f"{_FIX}") from error


def _reads_meta_device(value: Any) -> bool:
    found = False

    def visit(leaf: Any) -> Any:
        nonlocal found
        found = found or (isinstance(leaf, torch.device) and leaf.type == "meta") \
            or (isinstance(leaf, str) and leaf == "meta")
        return leaf

    fx.node.map_aggregate(value, visit)
    return found
