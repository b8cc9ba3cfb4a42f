"""Run the traced graph on the example input, one unit at a time.

The splitter needs real sizes (bytes handed between stages at each cut) and the ``"time"``
balance needs each unit's real inputs to profile it. Both come from one pass over the graph with
the example arguments. The pass runs under ``no_grad`` and inside
:func:`~.preserve.preserved_tensors_and_rng` and :func:`~.preserve.preserved_attributes`, so
BatchNorm statistics, the random streams and the attributes a leaf sets (a counter) are
exactly as before partitioning; values are freed after their last use.

This pass is also the first time the example meets the model's weights, so an example that is
not one valid call of ``forward`` (wrong feature size, wrong dtype) fails here: the failure is
re-raised as :class:`~.errors.ExampleInputError` naming the unit and module it happened in.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from lightning_gsched.errors import GschedError
from lightning_gsched.partition.errors import ExampleInputError
from lightning_gsched.partition.preserve import preserved_attributes, preserved_tensors_and_rng
from lightning_gsched.partition.tracer import TracedModel, target_name
from lightning_gsched.partition.units import Unit, UnitTable

# called with (unit, callable running the unit, args, kwargs) while the example runs
UnitHook = Callable[[Unit, Callable[..., Any], tuple[Any, ...], dict[str, Any]], None]


def value_bytes(value: Any) -> int:
    """Bytes of all tensors in a value (0 for ints, shapes, None...)."""
    return sum(
        t.numel() * t.element_size()
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
    )


def unit_callable(node: fx.Node, traced: TracedModel) -> Callable[..., Any]:
    """A function running ``node`` on concrete arguments (its module, function or method)."""
    if node.op == "call_module":
        module: Callable[..., Any] = traced.resolve(target_name(node))
        return module
    if node.op == "call_function":
        return node.target  # type: ignore[return-value]
    if node.op == "call_method":
        name = target_name(node)

        def call_method(obj: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(obj, name)(*args, **kwargs)

        return call_method
    raise ValueError(f"not a unit: {node.format_node()}")


def run_example(
    table: UnitTable, example_args: tuple[Any, ...], example_kwargs: dict[str, Any],
    hook: UnitHook | None = None,
) -> dict[fx.Node, int]:
    """Execute every unit on the example; returns the byte size of every value node."""
    traced = table.traced
    env: dict[fx.Node, Any] = dict(
        zip(table.placeholders, traced.inputs.flatten(example_args, example_kwargs), strict=True)
    )
    sizes = {node: value_bytes(value) for node, value in env.items()}

    def load(node: fx.Node) -> Any:
        return traced.resolve(target_name(node)) if node.op == "get_attr" else env[node]

    dying: dict[int, list[fx.Node]] = {}
    for value, last in table.last_use.items():
        dying.setdefault(last, []).append(value)
    # a leaf's forward may set its attributes (a counter, a cache): put back like its tensors
    with preserved_attributes(traced.module), preserved_tensors_and_rng(traced.module), \
            torch.no_grad():
        for unit in table.units:
            node = unit.node
            args = fx.node.map_arg(node.args, load)
            kwargs = fx.node.map_arg(node.kwargs, load)
            call = unit_callable(node, traced)
            try:
                if hook is not None:
                    hook(unit, call, args, kwargs)
                env[node] = call(*args, **kwargs)
            except GschedError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of the model on the example
                raise example_error(unit, table, args, kwargs, exc) from exc
            sizes[node] = value_bytes(env[node])
            for dead in dying.get(unit.index, ()):
                env.pop(dead, None)
    return sizes


def example_error(unit: Unit, table: UnitTable, args: Any, kwargs: Any,
                  exc: BaseException) -> ExampleInputError:
    """Where the example failed (unit, module), torch's message, and what to pass instead."""
    traced = table.traced
    owner = type(traced.module).__name__
    node = unit.node
    if node.op == "call_module":
        where = f"module {node.target!r} ({type(traced.resolve(target_name(node))).__name__})"
    elif unit.module_path:
        where = f"module {unit.module_path!r}"
    else:
        where = f"{owner}.forward itself"
    error = ExampleInputError(
        f"the example input does not fit {owner}: unit {unit.index} of {len(table)}, "
        f"{unit.describe()} in {where}, failed with {type(exc).__name__}: {exc} "
        f"(its inputs: {describe_values((args, kwargs))}). The example runs through the whole "
        "forward before it is cut, so no stage is at fault yet. example_args must be one call "
        f"of forward, e.g. partition(model, num_stages, (x,)) where model(x) works, with the "
        "batch dimension first and the dtype the model expects (token ids are integers)."
    )
    error.where = f"{unit.describe()} in {where}"
    return error


def describe_values(value: Any, limit: int = 4) -> str:
    """``Tensor(4, 3) float32, 2`` for the leaves of ``value`` (the first ``limit`` of them)."""
    leaves = pytree.tree_leaves(value)
    shown = [
        f"Tensor{tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
        if isinstance(leaf, torch.Tensor) else repr(leaf)[:40]
        for leaf in leaves[:limit]
    ]
    more = f", ... ({len(leaves) - limit} more)" if len(leaves) > limit else ""
    return (", ".join(shown) or "none") + more
