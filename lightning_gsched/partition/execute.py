"""Run the traced graph on the example input, one unit at a time.

The splitter needs real sizes (bytes handed between stages at each cut) and the ``"time"``
balance needs each unit's real inputs to profile it. Both come from one pass over the graph with
the example arguments. The pass runs under ``no_grad`` and inside
:func:`~.preserve.preserved_tensors_and_rng`, so BatchNorm statistics and the random streams are
exactly as before partitioning; values are freed after their last use.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from lightning_gsched.partition.preserve import preserved_tensors_and_rng
from lightning_gsched.partition.tracer import TracedModel
from lightning_gsched.partition.units import Unit, UnitTable

# called with (unit, callable running the unit, args, kwargs) while the example runs
UnitHook = Callable[[Unit, Callable[..., Any], tuple, dict], None]


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
        return traced.resolve(node.target)
    if node.op == "call_function":
        return node.target  # type: ignore[return-value]
    if node.op == "call_method":
        name = node.target

        def call_method(obj: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(obj, name)(*args, **kwargs)  # type: ignore[arg-type]

        return call_method
    raise ValueError(f"not a unit: {node.format_node()}")


def run_example(
    table: UnitTable, example_args: tuple, example_kwargs: dict, hook: UnitHook | None = None
) -> dict[fx.Node, int]:
    """Execute every unit on the example; returns the byte size of every value node."""
    traced = table.traced
    env: dict[fx.Node, Any] = dict(
        zip(table.placeholders, traced.inputs.flatten(example_args, example_kwargs))
    )
    sizes = {node: value_bytes(value) for node, value in env.items()}

    def load(node: fx.Node) -> Any:
        return traced.resolve(node.target) if node.op == "get_attr" else env[node]

    dying: dict[int, list[fx.Node]] = {}
    for value, last in table.last_use.items():
        dying.setdefault(last, []).append(value)
    with preserved_tensors_and_rng(traced.module), torch.no_grad():
        for unit in table.units:
            node = unit.node
            args = fx.node.map_arg(node.args, load)
            kwargs = fx.node.map_arg(node.kwargs, load)
            call = unit_callable(node, traced)
            if hook is not None:
                hook(unit, call, args, kwargs)  # type: ignore[arg-type]
            env[node] = call(*args, **kwargs)  # type: ignore[operator]
            sizes[node] = value_bytes(env[node])
            for dead in dying.get(unit.index, ()):
                env.pop(dead, None)
    return sizes
